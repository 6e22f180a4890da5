"""DevicePages: the ``KVStorage`` of a backend's KV pages as torch tensors (a GPU's).

Per layer, by the op's input names (``schema.INPUTS``)::

  key_cache, value_cache            [P, Hkv, ps, D]        hot pages, model dtype
  key_min, key_max                  [P + Pcold, Hkv, D]    every physical page, hot then cold
  key_cache_int8, value_cache_int8  [Pcold, Hkv, ps, D]    int8        (cold tier only;
                                    int4: [Pcold, Hkv, ps, D/2] uint8, two values per byte)
  key_scale, value_scale            [Pcold, Hkv, ps|1, D|1] float32 (int4: float16 [.., C])
  key_sub_bounds                    [P + Pcold, Hkv, r, D] uint8       (two-level only)

The cold format and scale shapes are the package's ``ColdCodec`` of each layer
(``contracts.cold_tier.tier_codecs``: an INT4 package's ``int8_layers`` hold INT8 pools, so
pools differ in dtype and shape between layers; the engine's node of each layer carries the
same format in its ``cold_format`` attribute), the same as ``HostKVStorage``'s.
``P``/``Pcold`` are a ``TieredPagePool``'s hot/cold slots; over a plain
``PagePool`` a package with a cold tier gets one unused cold page (the op's
``_int8``/``_int4`` overload needs one and the kernels check ``Ptot >= P + Pcold``; page
ids stay below ``P``, so it is never read).

The backend attaches it to its pool (``PagePool.attach_storage``); the pool keeps
the bookkeeping and asks for data moves with physical ids, as of any
``KVStorage``: :meth:`copy_page` (copy-on-write; a cold source is dequantized),
:meth:`demote_page` (quantize a full hot page into a cold slot) and
:meth:`write_tokens` (tests; on a GPU the backend's append kernel writes a step's
tokens itself and the pool only counts them). Demotions are queued and run
batched, one set of tensor ops per layer for all of a rebalance's pages, at the
next :meth:`flush` (the backend calls it before each step; a copy flushes
first, since it may read or overwrite a queued page). The math is
``ops.cold_codec``'s own - ``ColdCodec.quantize`` / ``dequantize`` run on these tensors (each
group's absmax, or the pool's static calibrated scales; INT4 keys on the page's own min/max) -
so a page demoted here holds the same int8/int4 values, scales and min/max as one demoted by
``HostKVStorage`` (``tests/runtime/test_device_pages.py``, on CPU tensors). New tokens are
written by the backend (``qsa_append_kv`` on a GPU) into the hot
pools and their metadata. torch is imported by the constructor only.

Two-level packages (the pool's ``sub_page_size``): the 4-bit sub-page codes are
``ops.fine_bounds``' numpy encoder's, computed on the host from the page's keys
and min/max and copied in (a synchronizing round trip) whenever a write, a
demotion or :meth:`refresh_sub_bounds` (after the append kernel wrote a step:
``PagePool.note_device_writes``) changes a page; a copy copies them. Until the
append kernel encodes them itself, that round trip is the price of two-level on
a GPU.

Page store (``runtime/kvstore``, issue #33): :meth:`read_block` / :meth:`write_block` move one
page, every layer, between the device and host arrays, each role gathered into one ``[L, ...]``
tensor and copied once (``store_copies.StoreCopies``: pinned staging buffers and a side stream
on a GPU; synchronous copies on the CPU stand-ins the tests use).
"""

from __future__ import annotations

import contextlib

import numpy as np

from tinyserve_trt.contracts.cold_tier import tier_codecs
from tinyserve_trt.ops.array_ns import TorchOps
from tinyserve_trt.ops.fine_bounds import pages_sub_bounds
from tinyserve_trt.runtime.kv_storage import COLD_ROLES, HOT_ROLES, SUB_ROLES, KVStorage

__all__ = ["COLD_ROLES", "HOT_ROLES", "SUB_ROLES", "DevicePages"]


class DevicePages(KVStorage):
    """The page tensors of every layer on ``device``, shaped for ``pool``.

    pool:      a ``PagePool`` or ``TieredPagePool`` (its geometry, tiers and static scales).
    dtype:     torch dtype of the hot pages and metadata.
    cold_tier: the package's ``cold_tier`` (format, granularities, group size), or None without one.
    stream:    a ``torch.cuda.Stream`` the copies and demotions run on (the backend's), or None.
    """

    def __init__(self, pool, dtype, device, cold_tier: dict | None = None, stream=None):
        import torch

        self._torch, self.dtype, self.device, self.stream = torch, dtype, device, stream
        host = pool.storage
        if host.num_cold and cold_tier is None:
            raise ValueError("a tiered page pool needs a package with a cold tier (exported with --calibration)")
        # the package's, per layer (int8_layers of an int4 package are INT8): its engine reads these pools
        self.codecs = tier_codecs(cold_tier, pool.num_layers) if cold_tier else None
        self.num_layers, self.num_kv_heads, self.page_size, self.head_dim = (
            pool.num_layers, pool.num_kv_heads, pool.page_size, pool.head_dim)
        self.num_hot = host.num_hot
        self.num_cold = host.num_cold or (1 if cold_tier else 0)
        self.granularities = (cold_tier["k_granularity"], cold_tier["v_granularity"]) if cold_tier else None
        self.sub_page_size = self.check_sub_page_size(host.sub_page_size)
        self.two_level_layers = host.two_level_layers
        h, ps, d = pool.num_kv_heads, pool.page_size, pool.head_dim
        total = self.num_hot + self.num_cold

        def zeros(*shape, dt=dtype):
            return torch.zeros(shape, dtype=dt, device=device)

        self.layers: list[dict] = []
        for layer in range(pool.num_layers):
            t = dict(key_cache=zeros(self.num_hot, h, ps, d), value_cache=zeros(self.num_hot, h, ps, d),
                     key_min=zeros(total, h, d), key_max=zeros(total, h, d))
            if self.codecs:  # as HostKVStorage: zero values (int4: nibbles q = 0), the layer codec's blank scales
                c = self.codecs[layer]
                vdt = TorchOps(torch, device).dtype(c.storage_dtype)
                for n, which in (("key", "k"), ("value", "v")):
                    t[f"{n}_cache_int8"] = zeros(self.num_cold, *c.pool_shape(h, ps, d), dt=vdt)
                    blank = torch.from_numpy(c.blank_scales(which, h, ps, d)).to(device)
                    t[f"{n}_scale"] = blank.expand(self.num_cold, *blank.shape).clone()
            if self.sub_page_size:
                t["key_sub_bounds"] = zeros(total, h, ps // self.sub_page_size, d, dt=torch.uint8)
            self.layers.append(t)
        self.static_scales = host.static_scales  # (K, V) page scales [L, Hkv, ps|1, D|1] (numpy), or None
        self.static = None if host.static_scales is None else [
            tuple(torch.from_numpy(s[layer]).to(device) for s in host.static_scales)
            for layer in range(pool.num_layers)]
        self._pending: list[tuple[int, int]] = []  # queued demotions (hot physical id, cold physical id)
        self._store_copies = None  # the page store's staging buffers and side stream, on first use

    def _on_stream(self):
        return self._torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    # ---- reads -----------------------------------------------------------------
    def cache_inputs(self, layer: int) -> dict:
        return self.layers[layer]

    def read_page(self, layer: int, page: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies to the host (synchronizing): checks and tests only."""
        self.check_range("read", page, 0, self.num_hot + self.num_cold)
        self.flush()
        t = self.layers[layer]
        if page < self.num_hot:
            keys = t["key_cache"][page]
        else:
            keys = self._cold_keys(layer, t, page,  # INT4: float32, as the op attends them (HostKVStorage._keys)
                                   self._torch.float32 if self.codecs[layer].keys_on_bounds else self.dtype)
        return tuple(x.cpu().numpy() for x in (keys, t["key_min"][page], t["key_max"][page]))

    def read_sub_bounds(self, layer: int, page: int) -> np.ndarray:
        if not self.sub_page_size:
            return super().read_sub_bounds(layer, page)
        self.check_range("read", page, 0, self.num_hot + self.num_cold)
        self.flush()
        return self.layers[layer]["key_sub_bounds"][page].cpu().numpy()

    # ---- data moves the pool asks for ------------------------------------------
    def reset_pages(self, pages: np.ndarray) -> None:
        """Nothing to do: the append kernel rewrites a page's min/max from its first token
        (and the sub-page codes are recomputed after every write), and the op never reads
        a page before (no tensor op per allocation)."""

    def write_tokens(self, layer: int, slots: np.ndarray, k, v, pages: np.ndarray, valid: np.ndarray) -> None:
        """Host arrays ``k, v [tokens, Hkv, D]`` into the hot slots, then min/max of ``pages``
        (what ``qsa_append_kv`` does on a GPU; the TensorRT backend runs the kernel instead)."""
        torch = self._torch
        self.check_range("write", slots // self.page_size, 0, self.num_hot)
        self.flush()
        t = self.layers[layer]
        page = torch.from_numpy(np.asarray(slots // self.page_size, np.int64)).to(self.device)
        off = torch.from_numpy(np.asarray(slots % self.page_size, np.int64)).to(self.device)
        pages_t = torch.from_numpy(np.asarray(pages, np.int64)).to(self.device)
        valid_t = torch.from_numpy(np.asarray(valid, np.int64)).to(self.device)
        with self._on_stream():
            t["key_cache"][page, :, off] = torch.as_tensor(np.asarray(k), device=self.device).to(self.dtype)
            t["value_cache"][page, :, off] = torch.as_tensor(np.asarray(v), device=self.device).to(self.dtype)
            self._refresh_minmax(t, pages_t, t["key_cache"][pages_t], valid_t)

    def _refresh_minmax(self, t: dict, pages, keys, valid) -> None:
        """key_min/key_max of physical ``pages`` from ``keys [U, Hkv, ps, D]`` over tokens ``[0, valid)``."""
        torch = self._torch
        mask = (torch.arange(self.page_size, device=self.device)[None, :] < valid[:, None])[:, None, :, None]
        inf = torch.tensor(float("inf"), dtype=keys.dtype, device=self.device)
        t["key_min"][pages] = torch.where(mask, keys, inf).amin(dim=2)
        t["key_max"][pages] = torch.where(mask, keys, -inf).amax(dim=2)
        if self.sub_page_size:  # after min/max: the codes are relative to them
            self._encode_sub(t, pages, keys, valid)

    def _encode_sub(self, t: dict, pages, keys, valid) -> None:
        """Sub-page codes of ``pages`` by ``ops.fine_bounds`` on the host (see the module docstring)."""
        codes = pages_sub_bounds(keys.cpu().numpy(), self.sub_page_size, t["key_min"][pages].cpu().numpy(),
                                 t["key_max"][pages].cpu().numpy(), valid.cpu().numpy())
        t["key_sub_bounds"][pages] = self._torch.from_numpy(codes).to(self.device)

    def refresh_sub_bounds(self, pages: np.ndarray, valid: np.ndarray) -> None:
        if not self.sub_page_size:
            return super().refresh_sub_bounds(pages, valid)
        torch = self._torch
        self.flush()
        pages_t = torch.from_numpy(np.asarray(pages, np.int64)).to(self.device)
        with self._on_stream():
            for layer, t in enumerate(self.layers):
                self._encode_sub(t, pages_t, t["key_cache"][pages_t],
                                 torch.from_numpy(np.asarray(valid[layer], np.int64)))

    def copy_page(self, src: int, dst: int) -> None:
        """Page ``src`` (hot, or cold: dequantized) into hot page ``dst``, metadata included."""
        self.check_range("copy target", dst, 0, self.num_hot)
        self.check_range("copy source", src, 0, self.num_hot + self.num_cold)
        self.flush()
        with self._on_stream():
            self._copy(src, dst)

    def _copy(self, src: int, dst: int) -> None:
        for layer, t in enumerate(self.layers):
            if src < self.num_hot:
                t["key_cache"][dst].copy_(t["key_cache"][src])
                t["value_cache"][dst].copy_(t["value_cache"][src])
            else:
                c = src - self.num_hot
                t["key_cache"][dst].copy_(self._cold_keys(layer, t, src, self.dtype))
                t["value_cache"][dst].copy_(self.codecs[layer].dequantize(t["value_cache_int8"][c],
                                                                          t["value_scale"][c], self.dtype))
            t["key_min"][dst].copy_(t["key_min"][src])
            t["key_max"][dst].copy_(t["key_max"][src])
            if self.sub_page_size:
                t["key_sub_bounds"][dst].copy_(t["key_sub_bounds"][src])
            # as HostKVStorage.copy_page: exact hot metadata
            if src >= self.num_hot and self.codecs[layer].keys_on_bounds:
                d = self._torch.tensor([dst], device=self.device)
                self._refresh_minmax(t, d, t["key_cache"][d], self._torch.full_like(d, self.page_size))

    def _cold_keys(self, layer: int, t: dict, page: int, dtype):
        """Cold physical ``page``'s keys in ``layer``, dequantized by its codec to ``dtype``."""
        c = page - self.num_hot
        return self.codecs[layer].dequantize_keys(t["key_cache_int8"][c], t["key_scale"][c], t["key_min"][page],
                                                  t["key_max"][page], dtype, self._codes(layer, t, page))

    def _codes(self, layer: int, t: dict, page):
        """``key_sub_bounds`` rows of ``page`` when ``layer``'s INT4 cold keys quantize on them
        (``keys_on_codes``), else None."""
        return t["key_sub_bounds"][page] if self.keys_on_codes(layer) else None

    def demote_page(self, hot: int, cold: int) -> None:
        """Queue: quantize full hot page ``hot`` into cold slot ``cold`` (a physical id
        ``>= num_hot``); its metadata becomes min/max of the dequantized keys (INT4: stays)."""
        if not self.granularities:
            raise ValueError("these pages have no cold tier")
        self.check_range("demoted", hot, 0, self.num_hot)
        self.check_range("cold", cold, self.num_hot, self.num_hot + self.num_cold)
        self._pending.append((hot, cold))

    def flush(self) -> None:
        """Run the queued demotions (all pages at once, per layer)."""
        if self._pending:
            with self._on_stream():
                self._demote_pending()

    def _demote_pending(self) -> None:
        torch = self._torch
        last = {}  # a cold slot demoted into twice (its first page evicted meanwhile) keeps the later page
        for h, c in self._pending:
            last[c] = h
        self._pending = []
        hot = torch.tensor(list(last.values()), dtype=torch.long, device=self.device)
        meta = torch.tensor(list(last), dtype=torch.long, device=self.device)
        cold = meta - self.num_hot
        for layer, t in enumerate(self.layers):
            ks, vs = self.static[layer] if self.static else (None, None)
            full = torch.full_like(meta, self.page_size)
            codec = self.codecs[layer]  # each layer with its own (int8_layers)
            if codec.keys_on_bounds:  # INT4 keys on the hot pages' (sub-page) bounds, which the cold pages keep
                bounds, codes = (t["key_min"][hot], t["key_max"][hot]), self._codes(layer, t, hot)
                q, s = codec.quantize(t["key_cache"][hot], "k", bounds=bounds, sub_codes=codes)
                t["key_cache_int8"][cold], t["key_scale"][cold] = q, s
                t["key_min"][meta], t["key_max"][meta] = bounds
                if codes is not None:  # format 3: the hot keys' codes hold the dequantized keys
                    t["key_sub_bounds"][meta] = codes
                elif self.sub_page_size:  # a single-level layer's node: codes of the keys it would attend
                    self._encode_sub(t, meta, codec.dequantize_keys(q, s, *bounds, torch.float32), full)
            else:
                q, s = codec.quantize(t["key_cache"][hot], "k", scale=ks)
                t["key_cache_int8"][cold], t["key_scale"][cold] = q, s
                keys = codec.dequantize(q, s, self.dtype)  # what the op attends: min/max describe these
                self._refresh_minmax(t, meta, keys, full)
            q, s = codec.quantize(t["value_cache"][hot], "v", scale=vs)
            t["value_cache_int8"][cold], t["value_scale"][cold] = q, s

    # ---- page store (runtime/kvstore) ------------------------------------------------
    _BLOCK_ROLES = (("k", "key_cache"), ("v", "value_cache"), ("key_min", "key_min"), ("key_max", "key_max"),
                    ("sub", "key_sub_bounds"))

    def read_block(self, page: int) -> dict:
        """Physical ``page``, every layer, as host arrays (copies; ``store_copies``): a cold page
        dequantized as :meth:`copy_page` makes it hot (INT4 keys: min/max and codes of the
        dequantized keys), as ``HostKVStorage.read_block``. Waits for the copies."""
        self.check_range("exported", page, 0, self.num_hot + self.num_cold)
        self.flush()
        torch = self._torch

        def gather():  # on the copies' stream
            per_layer = [self._page_of(layer, t, page) for layer, t in enumerate(self.layers)]
            return {name: torch.stack([parts[i] for parts in per_layer])
                    for i, (name, _) in enumerate(self._BLOCK_ROLES) if per_layer[0][i] is not None}

        out = self._copies().to_host(gather)
        out.setdefault("sub", None)
        return out

    def write_block(self, page: int, block) -> None:
        """A :meth:`read_block` of the same geometry into hot physical ``page`` (every layer);
        ValueError for another shape. On a GPU the compute stream's next work waits for the
        copies; the host does not."""
        self.check_range("imported", page, 0, self.num_hot)
        if (block.sub is not None) != bool(self.sub_page_size):
            raise ValueError("the block's sub-page bounds do not match this storage's")
        arrays, like = {}, {}
        for name, role in self._BLOCK_ROLES:
            arr = getattr(block, name)
            if arr is None:
                continue
            like[name] = self.layers[0][role]
            want = (self.num_layers, *like[name].shape[1:])
            if tuple(np.shape(arr)) != want:
                raise ValueError(f"block {name} is {tuple(np.shape(arr))}, this storage's pages are {want}")
            arrays[name] = arr
        self.flush()  # a queued demotion may still read this slot's previous page
        roles = dict(self._BLOCK_ROLES)

        def scatter(name, dev):  # on the copies' stream: dev [L, ...]
            for layer, t in enumerate(self.layers):
                t[roles[name]][page].copy_(dev[layer])

        self._copies().to_device(arrays, like, scatter)

    def _page_of(self, layer: int, t: dict, page: int) -> tuple:
        """``(k, v, key_min, key_max, sub)`` of physical ``page`` in ``layer`` as hot-page device
        tensors (``sub`` None without sub-page bounds); a cold page dequantized (as :meth:`_copy`)."""
        sub = t["key_sub_bounds"][page] if self.sub_page_size else None
        if page < self.num_hot:
            return t["key_cache"][page], t["value_cache"][page], t["key_min"][page], t["key_max"][page], sub
        c, codec = page - self.num_hot, self.codecs[layer]
        k = self._cold_keys(layer, t, page, self.dtype)
        v = codec.dequantize(t["value_cache_int8"][c], t["value_scale"][c], self.dtype)
        kmin, kmax = t["key_min"][page], t["key_max"][page]
        if codec.keys_on_bounds:  # a hot page's metadata is exact: of these keys
            kmin, kmax = k.amin(dim=1), k.amax(dim=1)
            if sub is not None:
                codes = pages_sub_bounds(k.cpu().numpy()[None], self.sub_page_size, kmin.cpu().numpy()[None],
                                         kmax.cpu().numpy()[None], np.array([self.page_size]))[0]
                sub = self._torch.from_numpy(codes).to(self.device)
        return k, v, kmin, kmax, sub

    def _copies(self):
        if self._store_copies is None:
            from tinyserve_trt.runtime.backends.store_copies import StoreCopies

            self._store_copies = StoreCopies(self._torch, self.device, self.stream)
        return self._store_copies
