"""DecodeBuckets: the fixed shapes a decode step is padded to, so it can replay a CUDA graph.

A captured graph is valid only for the input shapes (and tensor addresses) it was
captured with, so decode batches are padded up to a few bucket shapes
``[B, 1]`` x ``[B, W]``: the batch size to the next of 1, 2, 4, ..., 64 and the
page-table width to the next power of two, each capped at the engine profile's
maximum (which is itself a bucket, so every batch the profile admits has one).

Pure numpy, no torch or TensorRT: the TensorRT backend copies the padded arrays
into its static device buffers. Padding never changes what a real row computes:

- padding rows (after the real rows): token 0, position 0, ``past_lens`` 0,
  ``token_budget`` 0 (dense), a page-table row of page 0; their outputs are
  ignored and their K/V never reach the pool;
- padding columns: page 0, a valid id that the op never reads past ``past_lens``
  (the same convention as ``ScheduledBatch.page_table``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyserve_trt.runtime.batch import ScheduledBatch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def check_profile(batch: int, pages: int, max_batch: int, max_pages: int) -> None:
    """RuntimeError (one line) when a ``[batch, pages]`` step is outside the engine's profile."""
    if batch > max_batch or pages > max_pages:
        raise RuntimeError(f"batch {batch} x {pages} pages is outside the engine's profile "
                           f"({max_batch} x {max_pages}); lower max_batch or re-export")


def _capped(steps, cap: int) -> tuple[int, ...]:
    return tuple(s for s in steps if s < cap) + (cap,)


@dataclass(frozen=True)
class PaddedDecode:
    """One decode step's inputs at bucket shape ``[B, W]`` (int32 unless said otherwise).

    input_ids:    ``[B, 1]`` token ids.
    positions:    ``[B, 1]`` absolute positions.
    page_table:   ``[B, W]`` physical page ids.
    past_lens:    ``[B]`` tokens already cached.
    token_budget: ``[B]`` decode budget in tokens, 0 = dense.
    logits_index: ``[B]`` int64, index of each row's last new token (always 0 here).
    real:         ``[B]`` bool, True for the batch's rows (the first ``len(batch)``).
    """

    input_ids: np.ndarray
    positions: np.ndarray
    page_table: np.ndarray
    past_lens: np.ndarray
    token_budget: np.ndarray
    logits_index: np.ndarray
    real: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.page_table.shape


@dataclass(frozen=True)
class DecodeBuckets:
    """Bucket shapes under an engine profile of ``max_batch`` rows x ``max_pages`` pages."""

    max_batch: int
    max_pages: int

    def __post_init__(self):
        for name in ("max_batch", "max_pages"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """1, 2, 4, ..., 64 below ``max_batch``, then ``max_batch``."""
        return _capped(BATCH_BUCKETS, self.max_batch)

    @property
    def widths(self) -> tuple[int, ...]:
        """Powers of two below ``max_pages``, then ``max_pages``."""
        return _capped((1 << i for i in range(int(self.max_pages).bit_length())), self.max_pages)

    def shape(self, batch: int, pages: int) -> tuple[int, int]:
        """The smallest bucket ``(B, W)`` holding ``batch`` rows of ``pages`` page-table columns.

        RuntimeError (as ``check_profile``) above the profile; ValueError below 1.
        """
        if batch < 1 or pages < 1:
            raise ValueError(f"a decode bucket needs batch >= 1 and pages >= 1, got {batch} x {pages}")
        check_profile(batch, pages, self.max_batch, self.max_pages)
        return (next(b for b in self.batch_sizes if b >= batch), next(w for w in self.widths if w >= pages))

    def pad(self, batch: ScheduledBatch) -> PaddedDecode:
        """``batch`` (a decode batch: one new token per row) padded to its bucket.

        Does not modify ``batch``. ValueError for a batch with more than one new token
        per row or no rows; RuntimeError above the profile.
        """
        if batch.input_ids.ndim != 2 or batch.input_ids.shape[1] != 1:
            raise ValueError(f"only decode batches (one new token per row) are padded to a bucket, got "
                             f"input_ids of shape {batch.input_ids.shape}")
        n, width = len(batch), batch.page_table.shape[1]
        b, w = self.shape(n, width)
        ids, pos = np.zeros((b, 1), np.int32), np.zeros((b, 1), np.int32)
        table = np.zeros((b, w), np.int32)
        past, budget = np.zeros(b, np.int32), np.zeros(b, np.int32)
        ids[:n], pos[:n], table[:n, :width] = batch.input_ids, batch.positions, batch.page_table
        past[:n], budget[:n] = batch.past_lens, batch.token_budget
        real = np.arange(b) < n
        return PaddedDecode(ids, pos, table, past, budget, np.zeros(b, np.int64), real)
