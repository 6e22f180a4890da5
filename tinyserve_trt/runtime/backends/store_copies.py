"""StoreCopies: the page store's copies between a DevicePages' tensors and host arrays.

A page leaving for the store (``DevicePages.read_block``) or coming back (``write_block``)
crosses as one ``[L, ...]`` tensor per role, through a host staging buffer kept per role and
direction, reused page after page:

- on a GPU the buffers are pinned (page-locked: the copy is a DMA, asynchronous) and the copies
  run on a side stream of their own, which first waits for the compute stream's work (the
  backend's stream, else the current one): an export sees every token the step wrote. An
  export then waits for its copies (the host reads the arrays next). An import does not: the
  compute stream waits for its event, so the next step reads the page only once it is there,
  and the next import waits for it before it refills the staging buffers.
- on CPU tensors (the stand-ins ``tests/runtime/test_device_pages_store.py`` uses) the same
  calls copy synchronously.
torch comes from the caller (DevicePages imports it); nothing here imports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np


class StoreCopies:
    """Staging buffers and the side stream of one storage's page-store copies on ``device``."""

    def __init__(self, torch, device, stream=None):
        self._torch, self.device, self.stream = torch, device, stream
        self.cuda = torch.device(device).type == "cuda"
        self._side = None  # made on the first copy
        self._staging: dict[str, object] = {}
        self._import_done = None  # the last import's event: its staging buffers are free after it

    def to_host(self, gather: Callable[[], dict]) -> dict[str, np.ndarray]:
        """Run ``gather()`` (device tensors by name) on the copies' stream and return them as
        host arrays (copies), once copied."""
        side = self._side_stream()
        with self._on(side):
            bufs = {}
            for name, dev in gather().items():
                bufs[name] = self._stage(f"out:{name}", dev.shape, dev.dtype)
                bufs[name].copy_(dev, non_blocking=side is not None)
        if side is not None:
            side.synchronize()
        return {name: buf.numpy().copy() for name, buf in bufs.items()}  # the buffers are reused

    def to_device(self, arrays: dict[str, np.ndarray], like: dict, scatter: Callable[[str, object], None]) -> None:
        """Copy each host array ``arrays[name]`` (shape ``[L, *like[name].shape[1:]]``, cast to
        ``like[name]``'s dtype) to the device and hand it to ``scatter(name, tensor)``, on the
        copies' stream; the compute stream waits for them."""
        side = self._side_stream()
        if self._import_done is not None:
            self._import_done.synchronize()
        with self._on(side):
            for name, arr in arrays.items():
                host = self._stage(f"in:{name}", np.shape(arr), like[name].dtype)
                host.numpy()[...] = arr
                scatter(name, host.to(self.device, non_blocking=side is not None))
        if side is not None:
            self._import_done = side.record_event()
            self._compute_stream().wait_event(self._import_done)

    def _on(self, side):
        return self._torch.cuda.stream(side) if side is not None else contextlib.nullcontext()

    def _compute_stream(self):
        return self.stream if self.stream is not None else self._torch.cuda.current_stream(self.device)

    def _side_stream(self):
        """The copies' stream, after the compute stream's work so far; None on CPU tensors."""
        if not self.cuda:
            return None
        if self._side is None:
            self._side = self._torch.cuda.Stream(device=self.device)
        self._side.wait_stream(self._compute_stream())
        return self._side

    def _stage(self, key: str, shape, dtype):
        """The host buffer ``key`` of ``shape``/``dtype``, reused across pages (pinned on a GPU)."""
        buf = self._staging.get(key)
        if buf is None or tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
            buf = self._torch.empty(tuple(shape), dtype=dtype, pin_memory=self.cuda)
            self._staging[key] = buf
        return buf
