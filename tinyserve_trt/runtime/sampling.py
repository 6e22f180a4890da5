"""Sampling: per-request parameters and a numpy sampler over last-token logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tinyserve_trt.runtime.limits import (INT32_MAX, MAX_N, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                                         MAX_STOP_TOKEN_IDS, SEED_MAX, check_int, is_finite_number, is_int)


GREEDY_BELOW = 1e-5  # temperatures under this sample greedily


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature:        0 = greedy (argmax); > 0 divides the logits (below 1e-5: greedy).
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
    n:                  samples per prompt, at most ``limits.MAX_N``; the prompt's pages are
                        shared (copy-on-write).
    logprobs:           None = off; k >= 0 returns the chosen token's logprob and the top k.
    token_budget:       Quest decode budget in tokens for this request (overrides the scheduler's).

    Floats must be finite and ints int32-safe (``limits.py``); the bounds that depend on
    the package (budget within its context, ids in its vocabulary) are checked by
    ``limits.check_against_package`` when a request is added.
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
        # floats: finite only (inf/NaN would turn the logits into NaN)
        if not is_finite_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        check_int("top_k", self.top_k, 0)
        if not is_finite_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_finite_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        check_int("seed", self.seed, 0, SEED_MAX, optional=True)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop must be non-empty strings of at most {MAX_STOP_CHARS} characters, "
                             f"got {_short(self.stop)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if not all(is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {INT32_MAX}], got {_short(self.stop_token_ids)}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        check_int("max_tokens", self.max_tokens, 1)
        check_int("n", self.n, 1, MAX_N)
        check_int("logprobs", self.logprobs, 0, optional=True)
        check_int("token_budget", self.token_budget, 0, optional=True)


def _short(values) -> str:
    text = repr(values)
    return text if len(text) <= 80 else text[:77] + "..."


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
            params = seq.params
            if params.temperature < GREEDY_BELOW and params.repetition_penalty == 1.0 and not want[i]:
                # the float64 row's argmax, without the copy (float32 -> float64 is exact): ties and NaN alike
                tokens[i] = int(np.argmax(logits[i]))
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
        with np.errstate(over="ignore", invalid="ignore"):  # extreme params: handled below, not warned
            return Sampler._sample_row(row, params, history, rng)

    @staticmethod
    def _sample_row(row: np.ndarray, params: SamplingParams, history: Sequence[int],
                    rng: np.random.Generator) -> int:
        vocab = row.shape[0]
        if params.repetition_penalty != 1.0 and len(history):
            seen = np.unique(np.asarray(history, np.int64))
            seen = seen[(seen >= 0) & (seen < vocab)]
            vals = row[seen]
            row[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
        if params.temperature < GREEDY_BELOW:  # dividing by ~0 overflows to inf/NaN
            return int(np.argmax(row))
        row /= params.temperature
        if 0 < params.top_k < vocab:
            kth = np.partition(row, vocab - params.top_k)[vocab - params.top_k]
            row[row < kth] = -np.inf
        probs = np.exp(row - np.max(row))
        if not np.isfinite(probs).all():  # +inf logits (a huge penalty ratio): take the largest
            return int(np.argmax(row))
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
