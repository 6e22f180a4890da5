"""Run the CUDA kernels on torch tensors, with ``sparse_attention_ref``'s signature.

The tensors are CUDA tensors for the nvcc build of the library and host (CPU)
tensors for the emulated build (plugins/emulation), which runs the same kernel
sources on the CPU; ``library.load()`` decides which one is in use.

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


class _Device:
    """Where the loaded library's buffers live: CUDA memory for the nvcc build, host
    memory for the emulated one (``library.is_emulated``), whose launches finish
    before they return. Torch holds the buffers either way."""

    def __init__(self):
        import torch  # lazy: heavy

        self.torch = torch
        self.lib = library.load()
        self.emulated = library.is_emulated(self.lib)
        if not self.emulated and not torch.cuda.is_available():
            raise RuntimeError("torch has no CUDA device (and the loaded kernel library is not the emulated one)")
        self.name = "cpu" if self.emulated else "cuda"

    def stream(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(None if self.emulated else self.torch.cuda.current_stream().cuda_stream)

    def synchronize(self) -> None:
        if not self.emulated:
            self.torch.cuda.synchronize()

    def num_sms(self) -> int:
        return 0 if self.emulated else self.torch.cuda.get_device_properties(0).multi_processor_count

    def check_flags(self, flags, what: str) -> None:
        """After a synchronize: raise the KernelError the kernels' error flags stand for."""
        library.check_flags(int(flags[0]), what)


def _to_dev(dev: _Device, a, dtype=None):
    torch = dev.torch
    if a is None:
        return None
    # numpy inputs are copied (np.array): on the emulated (host) library a shared buffer
    # would let the kernels write into the caller's arrays
    t = a if isinstance(a, torch.Tensor) else torch.from_numpy(np.array(a, order="C", copy=True))
    t = t.to(dev.name)
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
                 key_sub_bounds=None, *, attrs: schema.OpAttributes | None = None, num_splits: int = 0,
                 poison: bool = True):
        dev = self.dev = _Device()
        torch = self.torch = dev.torch
        attrs = attrs or schema.OpAttributes()
        q = _to_dev(dev, query)
        if q.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"query dtype {q.dtype} is not float32/float16")
        dt = q.dtype
        t = {n: _to_dev(dev, a, dt) for n, a in dict(key=key, value=value, key_cache=key_cache,
                                                       value_cache=value_cache, key_min=key_min,
                                                       key_max=key_max).items()}
        ints = {n: _to_dev(dev, a, torch.int32) for n, a in dict(page_table=page_table, past_lens=past_lens,
                                                                   token_budget=token_budget).items()}
        # The cold tier keeps its own dtypes (schema.COLD_DTYPES: int8 pools + float32 scales,
        # or int4 = uint8 pools + float16 scales, told apart by the pools' dtype as in
        # ops.reference): never cast, a float pool passed here would be reinterpreted bytes,
        # so refuse it instead.
        cold = {n: _to_dev(dev, a) for n, a in dict(key_cache_int8=key_cache_int8,
                                                      value_cache_int8=value_cache_int8, key_scale=key_scale,
                                                      value_scale=value_scale).items()}
        cold["key_sub_bounds"] = _to_dev(dev, key_sub_bounds)  # uint8 codes: never cast either
        pool = cold["key_cache_int8"]
        self.cold_format = "int4" if pool is not None and pool.dtype == torch.uint8 else "int8"
        wanted = [getattr(torch, t) for t in schema.COLD_DTYPES[self.cold_format]] + [torch.uint8]
        for n, want in zip((*library.COLD_POINTERS, "key_sub_bounds"), wanted):
            if cold[n] is not None and cold[n].dtype != want:
                raise ValueError(f"{n} must be {want} ({self.cold_format} cold pages), got {cold[n].dtype}")
        self.output = torch.full_like(q, float("nan")) if poison else torch.empty_like(q)
        self.selected = torch.full((q.shape[0], t["key"].shape[1], ints["page_table"].shape[1]), 0xAA,
                                   dtype=torch.uint8, device=dev.name)
        self.flags = torch.zeros(1, dtype=torch.int32, device=dev.name)
        self._keep = {"query": q, **t, **ints, **cold, "output": self.output, "selected_pages": self.selected,
                      "error_flags": self.flags}
        p = self.params = library.forward_params(
            {n: None if x is None else tuple(x.shape) for n, x in self._keep.items()},
            {n: None if x is None else x.data_ptr() for n, x in self._keep.items()},
            "float16" if dt == torch.float16 else "float32", attrs, num_splits=num_splits,
            cold_format=self.cold_format)
        dims = p.dims
        self.lib = dev.lib
        ws_bytes = self.lib.qsa_workspace_size(ctypes.byref(dims))
        self.workspace = torch.full((max(ws_bytes, 1),), 0xFF if poison else 0, dtype=torch.uint8,
                                    device=dev.name)
        # selection units per sequence: H when each query head selects alone (group_reduce head), else Hkv
        self.kept_rows = self.lib.qsa_kept_rows(ctypes.byref(p))
        self.per_head = self.kept_rows == dims.num_heads  # a row per query head (or groups of one)
        self.num_splits = self.lib.qsa_forward_splits(ctypes.byref(p), dev.num_sms())  # what qsa_forward runs

    def kept_units(self) -> list[list[np.ndarray]]:
        """After a decode launch has run: the kept list the select kernels left in the workspace,
        ``[b][u] -> int array`` of units (ascending; unit = logical page // r, sub-page % r;
        r = 1 single-level), one row per selection unit ``u``: a KV head, or with ``per_head``
        (group_reduce head) a query head. Read through ``qsa_workspace_kept``'s offsets."""
        idx_off, cnt_off = ctypes.c_size_t(), ctypes.c_size_t()
        width = self.lib.qsa_workspace_kept(ctypes.byref(self.params.dims), ctypes.byref(idx_off),
                                            ctypes.byref(cnt_off))
        if width <= 0:
            raise ValueError("qsa_workspace_kept refused these dims")
        B, U = self.params.dims.batch, self.kept_rows
        ws = self.workspace.cpu().numpy()
        idx = ws[idx_off.value: idx_off.value + 4 * B * U * width].view(np.int32).reshape(B, U, width)
        cnt = ws[cnt_off.value: cnt_off.value + 4 * B * U].view(np.int32).reshape(B, U)
        return [[idx[b, u, : cnt[b, u]].copy() for u in range(U)] for b in range(B)]

    def launch(self) -> None:
        """Enqueue on torch's current stream; raises KernelError on a bad status. Does not sync
        (the kernels' error flags are read by ``sparse_attention_gpu`` after its sync)."""
        status = self.lib.qsa_forward(ctypes.byref(self.params), _ptr(self.workspace), self.workspace.numel(),
                                      self.dev.stream())
        if status != library.QSA_OK:
            raise library.KernelError(status, "qsa_forward")


def sparse_attention_gpu(*inputs, attrs: schema.OpAttributes | None = None, num_splits: int = 0,
                         poison: bool = True, **named):
    """Return ``(output [B, H, S, D], selected_pages [B, Hkv, NP] bool)`` computed on the GPU.

    Same arguments as ``sparse_attention_ref`` (``schema.INPUTS`` order or by
    name), including the optional cold tier (int8 pools + float32 scales, or packed
    int4 = uint8 pools + float16 scales; not cast) and two-level ``key_sub_bounds`` (uint8; not cast): numpy arrays (copied to
    the GPU; results come back as numpy) or CUDA tensors (results stay on the GPU).
    Does not modify the cache. Synchronises.
    """
    first = inputs[0] if inputs else named["query"]
    call = ForwardCall(*inputs, attrs=attrs, num_splits=num_splits, poison=poison, **named)
    call.launch()
    call.dev.synchronize()
    call.dev.check_flags(call.flags, "qsa_forward")
    sel = call.selected
    bad = int(((sel != 0) & (sel != 1)).sum())
    if bad:
        raise AssertionError(f"{bad} selected_pages entries were never written")
    if isinstance(first, np.ndarray):
        return call.output.cpu().numpy(), sel.bool().cpu().numpy()
    return call.output, sel.bool()


def append_kv_gpu(key, value, key_cache, value_cache, key_min, key_max, page_table, past_lens):
    """Write new tokens into the pages and refresh touched pages' metadata (``library.append_kv``).

    Tensors on the library's device are updated in place and returned; numpy inputs are
    copied, and the updated ``(key_cache, value_cache, key_min, key_max)`` come back as
    numpy. Synchronises, then raises KernelError for a bad page id or a full page table.
    """
    dev = _Device()
    torch = dev.torch
    as_numpy = isinstance(key, np.ndarray)
    k = _to_dev(dev, key)
    dt = k.dtype
    v = _to_dev(dev, value, dt)
    kc, vc, kmin, kmax = (_to_dev(dev, a, dt) for a in (key_cache, value_cache, key_min, key_max))
    table, past = _to_dev(dev, page_table, torch.int32), _to_dev(dev, past_lens, torch.int32)
    flags = torch.zeros(1, dtype=torch.int32, device=dev.name)
    tensors = dict(key=k, value=v, key_cache=kc, value_cache=vc, key_min=kmin, key_max=kmax, page_table=table,
                   past_lens=past, error_flags=flags)
    library.append_kv(dev.lib, {n: tuple(t.shape) for n, t in tensors.items()},
                      {n: t.data_ptr() for n, t in tensors.items()},
                      "float16" if dt == torch.float16 else "float32", dev.stream().value or 0)
    dev.synchronize()
    dev.check_flags(flags, "qsa_append_kv")
    if as_numpy:
        return tuple(a.cpu().numpy() for a in (kc, vc, kmin, kmax))
    return kc, vc, kmin, kmax
