"""ScheduledBatch: one step's work, as arrays ready for the model.

An engine step reads::

    batch = scheduler.schedule()
    outputs = backend.run(batch)          # writes each layer's new K/V with
                                          # pool.write_batch(layer, batch.slot_mapping, k, v)
    scheduler.postprocess(batch, sampler(outputs.logits, batch.seqs, batch.sample_mask))
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyserve_trt.contracts.budget import DecodeBudget
from tinyserve_trt.runtime.sequence import Sequence


@dataclass
class ScheduledBatch:
    """Rows are sequences; ``new`` is the widest row's count of new tokens.

    seqs:           the batch's sequences, row order.
    input_ids:      ``[batch, new]`` int32 token ids to compute, 0-padded.
    positions:      ``[batch, new]`` int32 absolute positions, 0-padded.
    num_new_tokens: ``[batch]`` int32 real new tokens per row (>= 1).
    past_lens:      ``[batch]`` int32 tokens already cached, excluding this step's.
    page_table:     ``[batch, max_pages]`` int32 physical page ids in logical order,
                    ``max_pages >= 1``; covers the past and this step's tokens; padding
                    is page 0 (a valid id, never read past ``past_lens``).
    slot_mapping:   ``[batch, new]`` int64 ``page * page_size + offset`` where each new
                    token's K/V goes; -1 for padding (and for rows cancelled in flight).
    token_budget:   ``[batch]`` int32 Quest decode budget in tokens, 0 = dense (prompt tokens,
                    and decode rows whose context is below ``sparse_min_ratio`` x budget).
    sample_mask:    ``[batch]`` bool, True where the row's last new token is the sequence's
                    last token, so its logits are sampled (False mid chunked prefill).
    """

    seqs: list[Sequence]
    input_ids: np.ndarray
    positions: np.ndarray
    num_new_tokens: np.ndarray
    past_lens: np.ndarray
    page_table: np.ndarray
    slot_mapping: np.ndarray
    token_budget: np.ndarray
    sample_mask: np.ndarray

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return int(self.num_new_tokens.sum())

    def record_selected_pages(self, selected_pages: np.ndarray, rows: np.ndarray | None = None) -> None:
        """Append each row's mean pages attended per KV head to its ``stats.pages_selected``.

        selected_pages: ``[batch, num_kv_heads, max_pages]`` bool, the op's output (stack
                        several layers along the head axis to average over them too).
        rows:           ``[batch]`` bool, rows to record (e.g. decode rows only); None = all.
        """
        selected_pages = np.asarray(selected_pages, bool)
        if selected_pages.shape[0] != len(self.seqs) or selected_pages.ndim != 3:
            raise ValueError(f"selected_pages must be [batch={len(self.seqs)}, Hkv, max_pages], "
                             f"got {selected_pages.shape}")
        per_row = selected_pages.sum(axis=2).mean(axis=1)
        for i, (seq, n) in enumerate(zip(self.seqs, per_row)):
            if rows is None or rows[i]:
                seq.stats.pages_selected.append(float(n))

    @classmethod
    def build(cls, rows: list[tuple[Sequence, int]], page_size: int, default_budget: int,
              sparse_min_ratio: float = 0.0, budget_share: float = 0.0) -> ScheduledBatch:
        """Arrays for ``rows`` of (sequence, new tokens); pages must already cover the slots.

        A row's budget: its request's ``token_budget`` (fixed), else ``DecodeBudget(default_budget,
        budget_share)`` at its context after this step.

        A row whose context after this step (``start + n`` tokens) is below ``sparse_min_ratio``
        times its budget gets budget 0: dense, exact, and no selection cost (``SchedulerConfig``)."""
        b = len(rows)
        default = DecodeBudget(default_budget, budget_share)
        width = max((n for _, n in rows), default=1)
        max_pages = max([len(s.pages) for s, _ in rows] + [1])
        input_ids = np.zeros((b, width), np.int32)
        positions = np.zeros((b, width), np.int32)
        slot_mapping = np.full((b, width), -1, np.int64)
        page_table = np.zeros((b, max_pages), np.int32)
        num_new = np.zeros(b, np.int32)
        past = np.zeros(b, np.int32)
        budget = np.zeros(b, np.int32)
        sample = np.zeros(b, bool)
        for i, (seq, n) in enumerate(rows):
            start = seq.num_cached_tokens
            pos = np.arange(start, start + n)
            pages = np.asarray(seq.pages, np.int64)
            input_ids[i, :n] = seq.token_ids[start:start + n]
            positions[i, :n] = pos
            slot_mapping[i, :n] = pages[pos // page_size] * page_size + pos % page_size
            page_table[i, :len(seq.pages)] = seq.pages
            num_new[i], past[i] = n, start
            override = seq.params.token_budget
            budget[i] = default.at(start + n) if override is None else override
            if start + n <= seq.num_prompt_tokens or start + n < sparse_min_ratio * budget[i]:
                # prompt tokens attend densely, as in a full prefill: a one-token step after a
                # prefix-cache hit (or a fork's recomputed last prompt token) is not a decode step;
                # and a context short for its budget decodes dense (the selection would not pay)
                budget[i] = 0
            sample[i] = start + n == seq.num_tokens
        return cls([s for s, _ in rows], input_ids, positions, num_new, past, page_table,
                   slot_mapping, budget, sample)
