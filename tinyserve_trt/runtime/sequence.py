"""Sequence: one generation stream (a request, or one of its n samples) and its stats."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from tinyserve_trt.runtime.sampling import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = "waiting"    # queued; holds no pages (new, or preempted to recompute)
    RUNNING = "running"    # admitted; holds the pages of its cached tokens
    FINISHED = "finished"  # done or cancelled; holds no pages


class FinishReason(str, Enum):
    STOP = "stop"            # a stop token / EOS / stop string
    LENGTH = "length"        # max_tokens or max_seq_len reached
    CANCELLED = "cancelled"  # Scheduler.cancel
    ERROR = "error"          # a page operation for it raised (``Sequence.error``); the engine went on


@dataclass
class SequenceStats:
    """Timestamps (the scheduler's clock, seconds) and cache counters of one sequence.

    ttft = first_token_time - arrival_time. ``pages_selected`` is filled by the
    engine from the op's ``selected_pages`` output (``ScheduledBatch.record_selected_pages``).
    """

    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    prefix_pages_reused: int = 0   # pages matched in the prefix cache at first admission
    prefix_tokens_reused: int = 0  # tokens whose prefill was skipped thanks to them
    prefix_pages_by_tier: dict = field(default_factory=dict)  # of those: {"pool"|"host"|"disk": pages}
    num_preemptions: int = 0
    pages_selected: list[float] = field(default_factory=list)  # per step, mean over KV heads

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def prefix_source(self) -> str:
        """Where its reused prefix came from: the slowest tier that served a page of it
        (``disk``, ``host``, ``pool``), or ``none`` (prefilled in full)."""
        return next((t for t in ("disk", "host", "pool") if self.prefix_pages_by_tier.get(t)), "none")


@dataclass(eq=False)
class Sequence:
    """Token ids, page table and progress of one stream.

    Invariants kept by the scheduler: tokens ``[0, num_cached_tokens)`` have their K/V
    in ``pages`` (``pages[i]`` holds logical page i); the tokens after them are
    computed by the next scheduled steps; ``page_hashes[i]`` is the prefix-cache
    chain hash of full page i (as far as it was computed).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0  # sample number within the request (0 .. n-1)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    pages: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    page_hashes: list[bytes] = field(default_factory=list)
    rng: np.random.Generator | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    stats: SequenceStats = field(default_factory=SequenceStats)
    forked: bool = False  # its n-1 siblings were created
    error: BaseException | None = None  # why it finished with FinishReason.ERROR

    def __post_init__(self):
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.rng is None:
            seed = self.params.seed
            self.rng = np.random.default_rng(None if seed is None else
                                             (seed if self.index == 0 else [seed, self.index]))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncached_tokens(self) -> int:
        """Tokens whose K/V the model still has to compute (1 when decoding)."""
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}#{self.index}, {self.status.value}, "
                f"tokens={self.num_tokens}, cached={self.num_cached_tokens}, pages={self.pages})")
