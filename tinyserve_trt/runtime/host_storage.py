"""HostKVStorage: a page pool's data as numpy arrays (what the ORT backend reads).

Per layer, by physical id (see ``kv_storage``): hot K/V ``[num_hot, Hkv, ps, D]``
in the pool dtype, key min/max ``[num_hot + num_cold, Hkv, D]``, and with a cold
tier int8 K/V ``[num_cold, Hkv, ps, D]`` with float32 scales, or packed int4
``[num_cold, Hkv, ps, D/2]`` uint8 (V with float16 scales + mins, K on the page's key
min/max - a two-level layer's: on its sub-page codes - which a demoted INT4 page keeps);
with two-level selection
uint8 ``key_sub_bounds [num_hot + num_cold, Hkv, r, D]``. Quantization is
``ops.cold_codec``'s and the sub-page codes ``ops.fine_bounds``', so the op's
reference reads exactly what was stored.
Arrays are ``np.zeros``: pages never written are never resident.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tinyserve_trt.cpu import append as native_append
from tinyserve_trt.ops.cold_codec import ColdCodec
from tinyserve_trt.ops.fine_bounds import pages_sub_bounds
from tinyserve_trt.runtime.append_bounds import append_bounds
from tinyserve_trt.runtime.kv_storage import KVStorage


class HostKVStorage(KVStorage):
    """Numpy page storage; ``granularities``/``static_scales`` as in :class:`KVStorage`;
    ``codec``: the cold format, one for every layer or a list with one per layer (an INT4
    package's ``int8_layers``; default: int8 with ``granularities``)."""

    def __init__(self, num_layers: int, num_hot: int, num_kv_heads: int, page_size: int, head_dim: int,
                 dtype, num_cold: int = 0, granularities: tuple[str, str] | None = None,
                 static_scales: tuple[np.ndarray, np.ndarray] | None = None,
                 codec: ColdCodec | Sequence[ColdCodec] | None = None, sub_page_size: int = 0,
                 two_level_layers=None):
        """``two_level_layers``: the layers whose op node is two-level (INT4 cold keys on the
        sub-page codes, ``KVStorage.keys_on_codes``); None = every layer."""
        codecs = None
        if codec is not None:
            codecs = [codec] * num_layers if isinstance(codec, ColdCodec) else list(codec)
            if len(codecs) != num_layers:
                raise ValueError(f"{len(codecs)} cold codecs for {num_layers} layers")
            granularities = (codecs[0].k_granularity, codecs[0].v_granularity)
        if (num_cold > 0) != (granularities is not None):
            raise ValueError("a cold tier needs both num_cold > 0 and its scale granularities")
        self.num_layers, self.num_hot, self.num_cold = num_layers, num_hot, num_cold
        self.num_kv_heads, self.page_size, self.head_dim = num_kv_heads, page_size, head_dim
        self.granularities, self.static_scales = granularities, static_scales
        self.sub_page_size = self.check_sub_page_size(sub_page_size)
        self.two_level_layers = frozenset(range(num_layers) if two_level_layers is None else map(int, two_level_layers))
        self.codecs = codecs or ([ColdCodec("int8", *granularities)] * num_layers if granularities else None)
        dtype = np.dtype(dtype)
        L, h, p, d = num_layers, num_kv_heads, page_size, head_dim
        self._k = np.zeros((L, num_hot, h, p, d), dtype)
        self._v = np.zeros((L, num_hot, h, p, d), dtype)
        self._key_min = np.zeros((L, num_hot + num_cold, h, d), dtype)
        self._key_max = np.zeros((L, num_hot + num_cold, h, d), dtype)
        if sub_page_size:
            self._sub = np.zeros((L, num_hot + num_cold, h, p // sub_page_size, d), np.uint8)
        if granularities:
            # per layer (their codecs' shapes and dtypes may differ): unused slots hold zero values
            # (int4: nibbles q = 0) and the codec's blank scales
            self._kq = [np.zeros((num_cold,) + c.pool_shape(h, p, d), c.storage_dtype) for c in self.codecs]
            self._vq = [np.zeros((num_cold,) + c.pool_shape(h, p, d), c.storage_dtype) for c in self.codecs]
            self._ks, self._vs = ([np.broadcast_to(c.blank_scales(w, h, p, d), (num_cold,) + c.scale_shape(w, h, p, d))
                                   .copy() for c in self.codecs] for w in "kv")

    @property
    def dtype(self) -> np.dtype:
        return self._k.dtype

    # ---- reads ------------------------------------------------------------------
    def cache_inputs(self, layer: int) -> dict[str, np.ndarray]:
        out = dict(key_cache=self._k[layer], value_cache=self._v[layer], key_min=self._key_min[layer],
                   key_max=self._key_max[layer])
        if self.granularities:
            out.update(key_cache_int8=self._kq[layer], value_cache_int8=self._vq[layer],
                       key_scale=self._ks[layer], value_scale=self._vs[layer])
        if self.sub_page_size:
            out["key_sub_bounds"] = self._sub[layer]
        return out

    def buffers(self) -> tuple[np.ndarray, ...]:
        """Every array :meth:`cache_inputs` takes its views from (a backend that bound those views
        checks these for a reallocation instead of every layer's views)."""
        out = (self._k, self._v, self._key_min, self._key_max)
        if self.granularities:
            out += (*self._kq, *self._vq, *self._ks, *self._vs)
        return out + ((self._sub,) if self.sub_page_size else ())

    def read_sub_bounds(self, layer: int, page: int) -> np.ndarray:
        if not self.sub_page_size:
            return super().read_sub_bounds(layer, page)
        self.check_range("read", page, 0, self.num_hot + self.num_cold)
        return self._sub[layer, page]

    def read_page(self, layer: int, page: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self.check_range("read", page, 0, self.num_hot + self.num_cold)
        return self._keys(layer, page), self._key_min[layer, page], self._key_max[layer, page]

    def _keys(self, layer: int, page: int) -> np.ndarray:
        """``[Hkv, ps, D]`` keys of physical ``page`` as the op reads them (pool dtype; a cold INT4
        page's float32: the op dequantizes them in float32 and never rounds to the pool dtype)."""
        if page < self.num_hot:
            return self._k[layer, page]
        c, codec = page - self.num_hot, self.codecs[layer]
        if codec.keys_on_bounds:  # float32, as the op attends them (the fine codes hold these)
            return codec.dequantize_keys(self._kq[layer][c], self._ks[layer][c], self._key_min[layer, page],
                                         self._key_max[layer, page], sub_codes=self._codes(layer, page))
        return codec.dequantize(self._kq[layer][c], self._ks[layer][c], self.dtype)

    def read_block(self, page: int) -> dict:
        """A cold page leaves as :meth:`copy_page` would make it hot (dequantized; INT4 layers'
        min/max and codes recomputed from the dequantized keys): what a promotion gives."""
        self.check_range("exported", page, 0, self.num_hot + self.num_cold)
        kmin, kmax = self._key_min[:, page].copy(), self._key_max[:, page].copy()
        sub = self._sub[:, page].copy() if self.sub_page_size else None
        if page < self.num_hot:
            return dict(k=self._k[:, page].copy(), v=self._v[:, page].copy(), key_min=kmin, key_max=kmax, sub=sub)
        c = page - self.num_hot
        k, v = np.empty_like(self._k[:, 0]), np.empty_like(self._v[:, 0])
        for layer, codec in enumerate(self.codecs):
            k[layer] = codec.dequantize_keys(self._kq[layer][c], self._ks[layer][c], kmin[layer], kmax[layer],
                                             self.dtype, sub_codes=self._codes(layer, page))
            v[layer] = codec.dequantize(self._vq[layer][c], self._vs[layer][c], self.dtype)
            if codec.keys_on_bounds:  # a hot page's metadata is exact: of these keys
                kmin[layer], kmax[layer] = k[layer].min(axis=1), k[layer].max(axis=1)
                if sub is not None:
                    sub[layer] = pages_sub_bounds(k[layer][None], self.sub_page_size, kmin[layer][None],
                                                  kmax[layer][None], np.array([self.page_size]))[0]
        return dict(k=k, v=v, key_min=kmin, key_max=kmax, sub=sub)

    def write_block(self, page: int, block) -> None:
        self.check_range("imported", page, 0, self.num_hot)
        if (block.sub is not None) != bool(self.sub_page_size):
            raise ValueError("the block's sub-page bounds do not match this storage's")
        self._k[:, page], self._v[:, page] = block.k, block.v  # numpy checks the shapes
        self._key_min[:, page], self._key_max[:, page] = block.key_min, block.key_max
        if self.sub_page_size:
            self._sub[:, page] = block.sub

    # ---- data moves -------------------------------------------------------------
    def reset_pages(self, pages: np.ndarray) -> None:
        self._key_min[:, pages] = 0
        self._key_max[:, pages] = 0
        if self.sub_page_size:
            self._sub[:, pages] = 0

    def write_tokens(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray, pages: np.ndarray,
                     valid: np.ndarray) -> None:
        self.check_range("write", slots // self.page_size, 0, self.num_hot)
        page, off = slots // self.page_size, slots % self.page_size
        self._k[layer, page, :, off, :] = k
        self._v[layer, page, :, off, :] = v
        self._refresh_minmax(layer, pages, self._k[layer, pages], valid)

    def write_layers(self, slots: np.ndarray, k: np.ndarray, v: np.ndarray, pages: np.ndarray,
                     valid: np.ndarray, before: np.ndarray | None = None) -> None:
        self.check_range("write", slots // self.page_size, 0, self.num_hot)
        page, off = slots // self.page_size, slots % self.page_size
        # the advanced indices are split by a slice: numpy puts the token axis first
        self._k[:, page, :, off, :] = np.swapaxes(k, 0, 1)
        self._v[:, page, :, off, :] = np.swapaxes(v, 0, 1)
        if before is not None and _one_append_per_page(page, off, pages, before):
            append_bounds(self._k, self._key_min, self._key_max, self._sub if self.sub_page_size else None,
                          page, off, k)
        else:
            self._refresh_pages(pages, valid)

    def _refresh_pages(self, pages: np.ndarray, valid: np.ndarray) -> None:
        """:meth:`_refresh_minmax` of ``pages`` in every layer (``valid [L, U]``): natively for a
        float32 pool (``cpu/append.py``'s ``page_bounds``, bit for bit, no copy of the pages) when
        the library is available, else in numpy."""
        sub = self._sub if self.sub_page_size else None
        if native_append.qualifies(self._k, self._key_min, self._key_max, sub, self._k) \
                and native_append.available() is None:
            native_append.page_bounds(self._k, self._key_min, self._key_max, sub, pages, valid)
        else:
            self._refresh_minmax(slice(None), pages, self._k[:, pages], valid)

    def copy_page(self, src: int, dst: int) -> None:
        self.check_range("copy target", dst, 0, self.num_hot)
        self.check_range("copy source", src, 0, self.num_hot + self.num_cold)
        if src < self.num_hot:
            self._k[:, dst], self._v[:, dst] = self._k[:, src], self._v[:, src]
        else:
            c = src - self.num_hot
            for layer, codec in enumerate(self.codecs):  # each layer with its own codec
                self._k[layer, dst] = codec.dequantize_keys(
                    self._kq[layer][c], self._ks[layer][c], self._key_min[layer, src], self._key_max[layer, src],
                    self.dtype, sub_codes=self._codes(layer, src))
                self._v[layer, dst] = codec.dequantize(self._vq[layer][c], self._vs[layer][c], self.dtype)
        for arr in (self._key_min, self._key_max) + ((self._sub,) if self.sub_page_size else ()):
            arr[:, dst] = arr[:, src]
        if src >= self.num_hot:
            # INT4 keys rounded to the pool dtype stay inside the page bounds (monotone rounding), but
            # a hot page's metadata is exact: recompute it (and fine codes of these keys)
            for layer in (i for i, c in enumerate(self.codecs) if c.keys_on_bounds):
                self._refresh_minmax(layer, np.array([dst]), self._k[layer, [dst]], np.array([self.page_size]))

    def demote_page(self, hot: int, cold: int) -> None:
        if not self.granularities:
            raise ValueError("these pages have no cold tier")
        self.check_range("demoted", hot, 0, self.num_hot)
        self.check_range("cold", cold, self.num_hot, self.num_hot + self.num_cold)
        c = cold - self.num_hot
        for layer, codec in enumerate(self.codecs):  # each layer with its own codec (int8_layers)
            ks, vs = (None, None) if self.static_scales is None else (s[layer] for s in self.static_scales)
            self._vq[layer][c], self._vs[layer][c] = codec.quantize(self._v[layer, hot], "v", scale=vs)
            if codec.keys_on_bounds:  # INT4 keys: quantized on the page's (sub-page) bounds, which stay
                bounds = self._key_min[layer, hot], self._key_max[layer, hot]
                codes = self._codes(layer, hot)
                self._kq[layer][c], self._ks[layer][c] = codec.quantize(self._k[layer, hot], "k", bounds=bounds,
                                                                        sub_codes=codes)
                self._key_min[layer, cold], self._key_max[layer, cold] = bounds
                if codes is not None:  # the hot keys' codes hold the dequantized keys (format 3)
                    self._sub[layer, cold] = codes
                elif self.sub_page_size:  # a single-level layer's node: codes of the keys it would attend
                    keys = codec.dequantize_keys(self._kq[layer][c], self._ks[layer][c], *bounds)
                    self._sub[layer, cold] = pages_sub_bounds(keys[None], self.sub_page_size, bounds[0][None],
                                                              bounds[1][None], np.array([self.page_size]))[0]
                continue
            self._kq[layer][c], self._ks[layer][c] = codec.quantize(self._k[layer, hot], "k", scale=ks)
            keys = self._keys(layer, cold)[None]  # what the op attends: min/max describe these
            self._refresh_minmax(layer, np.array([cold]), keys, np.array([self.page_size]))

    def _codes(self, layer: int, page):
        """``key_sub_bounds`` of physical ``page`` when ``layer``'s INT4 cold keys quantize on them
        (``keys_on_codes``), else None."""
        return self._sub[layer, page] if self.keys_on_codes(layer) else None

    def _refresh_minmax(self, layer, pages: np.ndarray, keys: np.ndarray, valid: np.ndarray) -> None:
        """key_min/key_max of physical ``pages`` from their ``keys [U, Hkv, ps, D]``, over
        tokens ``[0, valid)``: exact in the storage dtype, whatever the write order; then
        their sub-page codes. ``layer`` an index, or ``slice(None)`` with ``keys [L, U, Hkv, ps, D]``
        and ``valid [L, U]`` (every layer)."""
        valid = np.asarray(valid)
        mask = (np.arange(self.page_size) < valid[..., None])[..., None, :, None]
        big = np.array(np.inf, keys.dtype)
        # reductions with where=: no masked copy of every written page (a prefill writes them all)
        kmin = self._key_min[layer, pages] = keys.min(axis=-2, where=mask, initial=big)
        kmax = self._key_max[layer, pages] = keys.max(axis=-2, where=mask, initial=-big)
        if self.sub_page_size:  # after min/max: the codes are relative to them
            h, ps, d = keys.shape[-3:]
            codes = pages_sub_bounds(keys.reshape(-1, h, ps, d), self.sub_page_size, kmin.reshape(-1, h, d),
                                     kmax.reshape(-1, h, d), valid.reshape(-1))
            self._sub[layer, pages] = codes.reshape(keys.shape[:-3] + codes.shape[1:])

    def refresh_sub_bounds(self, pages: np.ndarray, valid: np.ndarray) -> None:
        if not self.sub_page_size:
            return super().refresh_sub_bounds(pages, valid)
        for layer in range(self.num_layers):
            self._sub[layer, pages] = pages_sub_bounds(self._k[layer, pages], self.sub_page_size,
                                                       self._key_min[layer, pages], self._key_max[layer, pages],
                                                       valid[layer])


def _one_append_per_page(page: np.ndarray, off: np.ndarray, pages: np.ndarray, before: np.ndarray) -> bool:
    """Whether each token is its page's only one and lands at the page's valid count in every
    layer (``before [L, len(pages)]``, ``pages`` sorted): a decode step's write."""
    if page.shape[0] != pages.shape[0]:
        return False
    at = np.searchsorted(pages, page)
    return bool(np.all(before[:, at] == off))
