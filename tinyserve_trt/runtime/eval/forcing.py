"""Teacher forcing through an Engine: chosen requests take given tokens, and their logprobs are kept.

The engine's sampler is the only thing replaced: scheduling, pages, the op and the backend run as
they do when serving. Row ``i`` of a step's logits predicts the next token of ``seqs[i]``; for a
forced request its ``j``-th output token is ``tokens[j]`` (whatever the model would pick), and
``logprobs[j]`` is that token's log-probability under the raw logits. Past its forced tokens a
request samples as its ``SamplingParams`` say (greedy for the passkey's answer).
"""

from __future__ import annotations

import numpy as np


class TeacherForcing:
    def __init__(self, engine):
        self.engine, self.base = engine, engine.sampler
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, list[float]] = {}
        engine.sampler = self

    def force(self, request_id: str, tokens) -> None:
        self.tokens[request_id] = [int(t) for t in tokens]
        self.logprobs[request_id] = []

    def close(self) -> None:
        """Give the engine its sampler back."""
        self.engine.sampler = self.base

    def __call__(self, logits, seqs, active=None):
        out = self.base(logits, seqs, active)
        for i, seq in enumerate(seqs):
            forced = self.tokens.get(seq.request_id)
            j = seq.num_output_tokens
            if forced is None or (active is not None and not active[i]) or j >= len(forced):
                continue
            row = np.asarray(logits[i], np.float64)
            top = row.max()
            self.logprobs[seq.request_id].append(float(row[forced[j]] - top - np.log(np.exp(row - top).sum())))
            out.token_ids[i] = forced[j]
        return out
