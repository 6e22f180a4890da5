"""Backend: runs one prepared ScheduledBatch through the model.

A backend reads the batch's arrays and the page pool's storage, runs the
model, writes each layer's new K/V into the pool (``PagePool.write_step``
with the batch's slot mapping) and returns the logits of each row's last new
token. It never allocates or frees pages: the scheduler reserved every slot
the batch writes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from tinyserve_trt.runtime.batch import ScheduledBatch


@dataclass
class StepOutput:
    """What one ``Backend.run`` returns.

    logits:         ``[batch, vocab]`` float32, row i at row i's last new token
                    (meaningful where ``batch.sample_mask``; the sampler skips the rest).
    selected_pages: per layer ``[batch, num_kv_heads, max_pages]`` bool, the op's
                    ``selected_pages`` output, or None when the backend does not report it.
    """

    logits: np.ndarray
    selected_pages: list[np.ndarray] | None = None


class Backend(ABC):
    """Runs a model package over a ``PagePool``; see the module docstring."""

    name: str = ""
    reads_cold_pages: bool = False  # binds a TieredPagePool's INT8 tier (pool.cache_inputs / physical_table)

    @abstractmethod
    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Compute ``batch`` and write its new K/V into the pool. Does not touch page ids."""

    def kernel_report(self):
        """What this backend runs: a ``kernel_report.KernelReport`` (graph, decode kernel, why), or
        None when it cannot say (then ``EngineConfig.require_native`` refuses it)."""

    def close(self) -> None:
        """Release sessions / device memory (idempotent)."""
