"""Run the CUDA kernels on torch CUDA tensors, with ``sparse_attention_ref``'s signature.

Why torch and not cupy: the GPU check also times torch's
``scaled_dot_product_attention`` as the baseline, so one array library covers
both; the kernels themselves are reached through ctypes (``library.py``).

Every call poisons its outputs (NaN, 0xAA bytes) and workspace (0xFF) before
the launch so a kernel that skips a write or reads uninitialised scratch shows
up in the comparison, then synchronises and raises ``KernelError`` on a bad
status. This is a test harness: it allocates per call, unlike the plugin.
"""

from __future__ import annotations

import ctypes

import numpy as np

from tinyserve_trt.ops import schema
from tinyserve_trt.cuda import library


def _torch():
    import torch  # lazy: heavy, and absent on CPU-only installs

    if not torch.cuda.is_available():
        raise RuntimeError("torch has no CUDA device")
    return torch


def _to_dev(torch, a, dtype=None):
    if a is None:
        return None
    t = a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))
    t = t.to("cuda")
    if dtype is not None:
        t = t.to(dtype)
    return t.contiguous()


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


class ForwardCall:
    """One prepared ``qsa_forward`` call: device buffers, params and workspace held, so
    ``launch()`` is only the kernels (for timing). Outputs: ``output``, ``selected`` (uint8)."""

    def __init__(self, query, key, value, key_cache, value_cache, key_min, key_max, page_table, past_lens,
                 token_budget, key_cache_int8=None, value_cache_int8=None, key_scale=None, value_scale=None,
                 *, attrs: schema.OpAttributes | None = None, num_splits: int = 0, poison: bool = True):
        torch = self.torch = _torch()
        attrs = attrs or schema.OpAttributes()
        q = _to_dev(torch, query)
        if q.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"query dtype {q.dtype} is not float32/float16")
        dt = q.dtype
        t = {n: _to_dev(torch, a, dt) for n, a in dict(key=key, value=value, key_cache=key_cache,
                                                       value_cache=value_cache, key_min=key_min,
                                                       key_max=key_max).items()}
        ints = {n: _to_dev(torch, a, torch.int32) for n, a in dict(page_table=page_table, past_lens=past_lens,
                                                                   token_budget=token_budget).items()}
        # The cold tier keeps its own dtypes (int8 pools, float32 scales): never cast, a
        # float pool passed here would be reinterpreted bytes, so refuse it instead.
        cold = {n: _to_dev(torch, a) for n, a in dict(key_cache_int8=key_cache_int8,
                                                      value_cache_int8=value_cache_int8, key_scale=key_scale,
                                                      value_scale=value_scale).items()}
        for n, want in zip(library.COLD_POINTERS, (torch.int8, torch.int8, torch.float32, torch.float32)):
            if cold[n] is not None and cold[n].dtype != want:
                raise ValueError(f"{n} must be {want}, got {cold[n].dtype}")
        self.output = torch.full_like(q, float("nan")) if poison else torch.empty_like(q)
        self.selected = torch.full((q.shape[0], t["key"].shape[1], ints["page_table"].shape[1]), 0xAA,
                                   dtype=torch.uint8, device="cuda")
        self._keep = {"query": q, **t, **ints, **cold, "output": self.output, "selected_pages": self.selected}
        p = self.params = library.forward_params(
            {n: None if x is None else tuple(x.shape) for n, x in self._keep.items()},
            {n: None if x is None else x.data_ptr() for n, x in self._keep.items()},
            "float16" if dt == torch.float16 else "float32", attrs, num_splits=num_splits)
        dims = p.dims
        self.lib = library.load()
        ws_bytes = self.lib.qsa_workspace_size(ctypes.byref(dims))
        self.workspace = torch.full((max(ws_bytes, 1),), 0xFF if poison else 0, dtype=torch.uint8, device="cuda")
        self.num_splits = self.lib.qsa_num_splits(ctypes.byref(dims), num_splits,
                                                  torch.cuda.get_device_properties(0).multi_processor_count)

    def launch(self) -> None:
        """Enqueue on torch's current stream; raises KernelError on a bad status. Does not sync."""
        stream = self.torch.cuda.current_stream().cuda_stream
        status = self.lib.qsa_forward(ctypes.byref(self.params), _ptr(self.workspace), self.workspace.numel(),
                                      ctypes.c_void_p(stream))
        if status != library.QSA_OK:
            raise library.KernelError(status, "qsa_forward")


def sparse_attention_gpu(*inputs, attrs: schema.OpAttributes | None = None, num_splits: int = 0,
                         poison: bool = True, **named):
    """Return ``(output [B, H, S, D], selected_pages [B, Hkv, NP] bool)`` computed on the GPU.

    Same arguments as ``sparse_attention_ref`` (``schema.INPUTS`` order or by
    name), including the optional INT8 cold tier (int8 pools, float32 scales; not
    cast): numpy arrays (copied to the GPU; results come back as numpy) or CUDA
    tensors (results stay on the GPU). Does not modify the cache. Synchronises.
    """
    first = inputs[0] if inputs else named["query"]
    call = ForwardCall(*inputs, attrs=attrs, num_splits=num_splits, poison=poison, **named)
    call.launch()
    call.torch.cuda.synchronize()
    sel = call.selected
    bad = int(((sel != 0) & (sel != 1)).sum())
    if bad:
        raise AssertionError(f"{bad} selected_pages entries were never written")
    if isinstance(first, np.ndarray):
        return call.output.cpu().numpy(), sel.bool().cpu().numpy()
    return call.output, sel.bool()


def append_kv_gpu(key, value, key_cache, value_cache, key_min, key_max, page_table, past_lens):
    """Write new tokens into the pages and refresh touched pages' metadata.

    CUDA tensors are updated in place and returned; numpy inputs are copied,
    and the updated ``(key_cache, value_cache, key_min, key_max)`` come back as numpy.
    """
    torch = _torch()
    as_numpy = isinstance(key, np.ndarray)
    k = _to_dev(torch, key)
    dt = k.dtype
    v = _to_dev(torch, value, dt)
    kc, vc, kmin, kmax = (_to_dev(torch, a, dt) for a in (key_cache, value_cache, key_min, key_max))
    table, past = _to_dev(torch, page_table, torch.int32), _to_dev(torch, past_lens, torch.int32)
    B, Hkv, S, D = k.shape
    p = library.QsaAppendParams()
    p.dims = library.QsaDims(B, Hkv, Hkv, S, D, kc.shape[0], kc.shape[2], table.shape[1], kmin.shape[0])
    p.dtype = library.DTYPES["float16" if dt == torch.float16 else "float32"]
    for name, tensor in dict(key=k, value=v, key_cache=kc, value_cache=vc, key_min=kmin, key_max=kmax,
                             page_table=table, past_lens=past).items():
        setattr(p, name, _ptr(tensor))
    status = library.load().qsa_append_kv(ctypes.byref(p), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    if status != library.QSA_OK:
        raise library.KernelError(status, "qsa_append_kv")
    torch.cuda.synchronize()
    if as_numpy:
        return tuple(a.cpu().numpy() for a in (kc, vc, kmin, kmax))
    return kc, vc, kmin, kmax
