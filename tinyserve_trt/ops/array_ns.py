"""The few array operations the cold codec is written in, for numpy arrays and torch tensors.

``ops/cold_codec.py`` (and ``fine_bounds.decode``) define the cold page format once, in
operators numpy and torch share (``+ - * / & | >> <<``, comparisons, slicing, ``reshape``)
and the calls below, which the two spell differently. ``namespace(x)`` picks numpy's or,
for a torch tensor, torch's on that tensor's device: the same lines then run in numpy on
the host (the reference, the CPU pools, calibration) and in torch on a GPU
(``runtime/backends/device_pages.py``), so the two cannot drift apart. Both round the same
way where the format needs it: ``rint`` is round-half-to-even in both, each elementwise op
rounds once (torch's eager ops fuse no FMA), conversions are direct.

torch is never imported here: a tensor's own module is used (it is loaded, or there would be
no tensor), so ``import tinyserve_trt`` stays numpy-only.
"""

from __future__ import annotations

import sys

import numpy as np


class NumpyOps:
    """numpy's spelling of the ops (host arrays)."""

    def asarray(self, x, dtype=None):
        return np.asarray(x, dtype)

    def astype(self, x, dtype):
        return np.asarray(x).astype(dtype)

    def bitcast(self, x, dtype):
        """The same bits as ``dtype`` (equal item size)."""
        return np.ascontiguousarray(x).view(dtype)

    def repeat(self, x, n: int, axis: int):
        return np.repeat(x, n, axis=axis)

    def concat(self, xs, axis: int):
        return np.concatenate(xs, axis=axis)

    def amin(self, x, axis: int, keepdims: bool = False):
        return x.min(axis=axis, keepdims=keepdims)

    def amax(self, x, axis: int, keepdims: bool = False):
        return x.max(axis=axis, keepdims=keepdims)

    def arange(self, n: int):
        return np.arange(n)

    def ones(self, shape, dtype):
        return np.ones(tuple(shape), dtype)

    def broadcast_to(self, x, shape):
        return np.broadcast_to(x, tuple(shape))

    def copy(self, x):
        return np.array(x, copy=True)

    def where(self, cond, a, b):
        return np.where(cond, a, b)

    def clip(self, x, lo, hi):
        return np.clip(x, lo, hi)

    def rint(self, x):
        return np.rint(x)

    def isfinite(self, x):
        return np.isfinite(x)


class TorchOps:
    """torch's spelling of the same ops, creating tensors on ``device``."""

    def __init__(self, torch, device):
        self.torch, self.device = torch, device

    def dtype(self, dtype):
        """A torch dtype for a numpy dtype (or name), or ``dtype`` itself."""
        return dtype if isinstance(dtype, self.torch.dtype) else getattr(self.torch, np.dtype(dtype).name)

    def asarray(self, x, dtype=None):
        return self.torch.as_tensor(x, dtype=None if dtype is None else self.dtype(dtype), device=self.device)

    def astype(self, x, dtype):
        return self.asarray(x).to(self.dtype(dtype))

    def bitcast(self, x, dtype):
        return x.contiguous().view(self.dtype(dtype))

    def repeat(self, x, n: int, axis: int):
        return x.repeat_interleave(n, dim=axis)

    def concat(self, xs, axis: int):
        return self.torch.cat(list(xs), dim=axis)

    def amin(self, x, axis: int, keepdims: bool = False):
        return x.amin(dim=axis, keepdim=keepdims)

    def amax(self, x, axis: int, keepdims: bool = False):
        return x.amax(dim=axis, keepdim=keepdims)

    def arange(self, n: int):
        return self.torch.arange(n, device=self.device)

    def ones(self, shape, dtype):
        return self.torch.ones(tuple(shape), dtype=self.dtype(dtype), device=self.device)

    def broadcast_to(self, x, shape):
        return x.expand(tuple(shape))

    def copy(self, x):
        return x.clone()

    def where(self, cond, a, b):
        return self.torch.where(cond, a, b)

    def clip(self, x, lo, hi):
        return self.torch.clamp(x, lo, hi)

    def rint(self, x):
        return self.torch.round(x)  # half to even, as np.rint

    def isfinite(self, x):
        return self.torch.isfinite(x)


NUMPY = NumpyOps()


def namespace(*arrays) -> NumpyOps | TorchOps:
    """torch's ops (on the first tensor's device) when one of ``arrays`` is a torch tensor, else numpy's."""
    torch = sys.modules.get("torch")
    if torch is not None:
        for a in arrays:
            if isinstance(a, torch.Tensor):
                return TorchOps(torch, a.device)
    return NUMPY
