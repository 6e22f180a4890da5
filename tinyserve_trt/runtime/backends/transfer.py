"""TransferCounter: bytes a backend moves between host and device, per step and in total.

A backend that keeps its KV pages on a device routes every host -> device upload
and device -> host download of a step through :meth:`upload` / :meth:`download`,
so the counter is the record of what crossed, by name: ``last_h2d`` / ``last_d2h``
(``{name: bytes}`` of the last step) and the totals. With device-resident pages a
step should move O(new tokens + page-table width) bytes, never O(pool); the
tests and ``Engine.stats()`` (``transfer_*`` keys) read it from here.

``fed`` counts what a step hands to the runtime from host memory without a device
copy (the CPU EP's feeds), so a CPU backend reports honest zeros for h2d/d2h and
still says what it fed. torch is only touched through the tensors passed in.
"""

from __future__ import annotations

import numpy as np


class TransferCounter:
    """Per-step and total host <-> device bytes; :meth:`begin_step` starts a step."""

    def __init__(self, device: str = "cpu"):
        self.device = device  # "cuda" when pages live on a GPU, "cpu" otherwise
        self.steps = 0
        self.total_h2d = self.total_d2h = self.total_fed = 0
        self.last_h2d: dict[str, int] = {}
        self.last_d2h: dict[str, int] = {}
        self.last_fed: dict[str, int] = {}

    def begin_step(self) -> None:
        self.steps += 1
        self.last_h2d, self.last_d2h, self.last_fed = {}, {}, {}

    def upload(self, torch, name: str, array: np.ndarray, device, dtype=None):
        """``array`` (host) as a tensor on ``device``; counts its bytes as host -> device."""
        host = np.ascontiguousarray(array, dtype)
        self._add(self.last_h2d, name, host.nbytes)
        self.total_h2d += host.nbytes
        return torch.from_numpy(host).to(device, non_blocking=False)

    def download(self, name: str, tensor) -> np.ndarray:
        """``tensor`` (device) as a host numpy array; counts its bytes as device -> host."""
        host = tensor.cpu().numpy()
        self._add(self.last_d2h, name, host.nbytes)
        self.total_d2h += host.nbytes
        return host

    def fed(self, name: str, nbytes: int) -> None:
        """A host array handed to the runtime without a device copy (CPU EP feeds)."""
        self._add(self.last_fed, name, int(nbytes))
        self.total_fed += int(nbytes)

    @staticmethod
    def _add(log: dict, name: str, nbytes: int) -> None:
        log[name] = log.get(name, 0) + nbytes

    @property
    def step_h2d(self) -> int:
        return sum(self.last_h2d.values())

    @property
    def step_d2h(self) -> int:
        return sum(self.last_d2h.values())

    def stats(self) -> dict:
        """The ``transfer_*`` entries of ``Engine.stats()``."""
        return dict(transfer_device=self.device, transfer_h2d_bytes=self.total_h2d,
                    transfer_d2h_bytes=self.total_d2h, transfer_h2d_bytes_last_step=self.step_h2d,
                    transfer_d2h_bytes_last_step=self.step_d2h, transfer_fed_bytes=self.total_fed)
