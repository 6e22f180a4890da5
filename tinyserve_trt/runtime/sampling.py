"""Sampling: per-request parameters and a numpy sampler over last-token logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature:        0 = greedy (argmax); > 0 divides the logits.
    top_k:              keep the k most likely tokens; 0 = off.
    top_p:              keep the smallest set whose probability reaches top_p; 1 = off.
    repetition_penalty: > 1 discourages tokens already in the prompt or output (CTRL rule:
                        positive logits divided, negative multiplied); 1 = off.
    seed:               per-request RNG seed (reproducible whatever the batching); None = random.
    stop:               strings that end generation; checked by the engine, which has the
                        tokenizer (it calls ``Scheduler.finish``).
    stop_token_ids:     token ids that end generation (the token is kept in the output).
    ignore_eos:         keep generating past the model's EOS token.
    max_tokens:         most tokens to generate.
    n:                  samples per prompt; the prompt's pages are shared (copy-on-write).
    logprobs:           None = off; k >= 0 returns the chosen token's logprob and the top k.
    token_budget:       Quest decode budget in tokens for this request (overrides the scheduler's).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_tokens: int = 16
    n: int = 1
    logprobs: int | None = None
    token_budget: int | None = None

    def __post_init__(self):
        # Lists are accepted for convenience; stored as tuples to stay hashable and frozen.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be an int >= 0 or None, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an int >= 0 or None, got {self.logprobs!r}")
        if self.token_budget is not None and (not _is_int(self.token_budget) or self.token_budget < 0):
            raise ValueError(f"token_budget must be an int >= 0 or None, got {self.token_budget!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SampleOutput:
    """What :class:`Sampler` returns for a batch.

    token_ids:    ``[batch]`` int64; -1 on rows that were not sampled.
    logprobs:     ``[batch]`` float32 logprob of the chosen token under the raw model
                  distribution (NaN where not requested), or None when no row asked.
    top_logprobs: per row, ``[(token_id, logprob), ...]`` most likely first, or None.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray | None = None
    top_logprobs: list[list[tuple[int, float]] | None] | None = None


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x)
    return x - m - np.log(np.sum(np.exp(x - m)))


class Sampler:
    """Turn ``logits [batch, vocab]`` into one token per row.

    Each row reads its sequence's ``params`` (SamplingParams), ``token_ids`` (prompt +
    output, for the repetition penalty) and ``rng`` (a numpy Generator, so a seeded
    request draws the same tokens whatever else is in the batch). Does not modify
    the sequences beyond advancing their RNGs.
    """

    def __init__(self, seed: int | None = None):
        self._fallback = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray, seqs: Sequence, active: np.ndarray | None = None) -> SampleOutput:
        """Sample ``logits [batch, vocab]`` for ``seqs``; rows where ``active`` is False get -1."""
        logits = np.asarray(logits)
        if logits.ndim != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [batch={len(seqs)}, vocab], got {logits.shape}")
        batch = logits.shape[0]
        active = np.ones(batch, bool) if active is None else np.asarray(active, bool)
        tokens = np.full(batch, -1, np.int64)
        want = [active[i] and seqs[i].params.logprobs is not None for i in range(batch)]
        logprobs = np.full(batch, np.nan, np.float32) if any(want) else None
        tops: list | None = [None] * batch if any(want) else None
        for i, seq in enumerate(seqs):
            if not active[i]:
                continue
            row = logits[i].astype(np.float64)
            rng = getattr(seq, "rng", None)
            rng = self._fallback if rng is None else rng
            tokens[i] = self.sample_row(row, seq.params, seq.token_ids, rng)
            if want[i]:
                lp = log_softmax(row)
                logprobs[i] = lp[tokens[i]]
                k = min(seq.params.logprobs, lp.shape[0])
                top = np.argsort(-lp, kind="stable")[:k]
                tops[i] = [(int(t), float(lp[t])) for t in top]
        return SampleOutput(tokens, logprobs, tops)

    @staticmethod
    def sample_row(row: np.ndarray, params: SamplingParams, history: Sequence[int],
                   rng: np.random.Generator) -> int:
        """One token from ``row [vocab]`` (float64, modified in place)."""
        vocab = row.shape[0]
        if params.repetition_penalty != 1.0 and len(history):
            seen = np.unique(np.asarray(history, np.int64))
            seen = seen[(seen >= 0) & (seen < vocab)]
            vals = row[seen]
            row[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
        if params.temperature == 0:
            return int(np.argmax(row))
        row /= params.temperature
        if 0 < params.top_k < vocab:
            kth = np.partition(row, vocab - params.top_k)[vocab - params.top_k]
            row[row < kth] = -np.inf
        probs = np.exp(row - np.max(row))
        probs /= probs.sum()
        if params.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            sorted_p = probs[order]
            # keep a token while the mass before it is still short of top_p (always keeps the first)
            drop = (np.cumsum(sorted_p) - sorted_p) >= params.top_p
            probs[order[drop]] = 0.0
        cdf = np.cumsum(probs)
        pick = np.searchsorted(cdf, rng.random() * cdf[-1], side="right")
        return int(min(pick, vocab - 1))
