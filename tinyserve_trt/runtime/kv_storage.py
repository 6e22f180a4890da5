"""KVStorage: where a page pool's K/V data and per-page key min/max live.

A :class:`~tinyserve_trt.runtime.pages.PagePool` owns page ids, handles,
refcounts, valid-token counts and tiers; it moves no data itself. Every data
operation goes through its storage, addressed by *physical* page id (the id the
op's ``page_table`` holds), with the op's tensors by schema name::

  key_cache, value_cache            [num_hot, Hkv, ps, D]         hot pages, pool dtype
  key_min, key_max                  [num_hot + num_cold, Hkv, D]  every physical page
  key_cache_int8, value_cache_int8  [num_cold, Hkv, ps, D]        int8      (cold tier only;
                                    int4: [num_cold, Hkv, ps, D/2] uint8, two values per byte)
  key_scale, value_scale            [num_cold, Hkv, ps|1, D|1]    float32   (int4: float16 K [.., 1, 1]
                                                                            placeholder, V [.., 2C]
                                                                            scales + mins)
  key_sub_bounds                    [num_hot + num_cold, Hkv, r, D] uint8   (two-level only)

Physical ids ``[0, num_hot)`` are hot, ``[num_hot, num_hot + num_cold)`` cold.
Key min/max are kept by the storage, indexed by the same physical id as the
page: the storage updates them whenever it writes, copies or demotes a page.
Two-level selection (``sub_page_size`` > 0, ``r = page_size / sub_page_size``):
``key_sub_bounds`` holds each page's 4-bit sub-page codes relative to its
min/max (``ops.fine_bounds``), indexed the same way and kept with them: a write
recomputes the touched pages' codes over their valid tokens after their min/max
(a new min/max moves every code of the page), a copy copies them (from a cold
INT4 page: recomputes both from the copied keys), an INT8 demotion recomputes them from
the dequantized keys against the recomputed min/max. An INT4 demotion changes no
metadata (format 3, ``ops.cold_codec``): the keys quantize on the page's min/max - in a layer
whose op node is two-level (``two_level_layers``): on each sub-page's decoded codes - which
therefore still hold the dequantized keys. A single-level layer of a two-level pool (the
package's dense layers) gets codes of its dequantized keys, as INT8.

Implementations: ``host_storage.HostKVStorage`` (numpy, what the ORT backend
reads) and ``backends.device_pages.DevicePages`` (torch tensors on the TensorRT
backend's GPU, attached with ``PagePool.attach_storage``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

HOT_ROLES = ("key_cache", "value_cache", "key_min", "key_max")
COLD_ROLES = ("key_cache_int8", "value_cache_int8", "key_scale", "value_scale")
SUB_ROLES = ("key_sub_bounds",)  # ops.schema.TWO_LEVEL_INPUTS


class KVStorage(ABC):
    """Page data of every layer, by physical id.

    Geometry: ``num_layers``, ``num_hot``, ``num_cold``, ``num_kv_heads``,
    ``page_size``, ``head_dim``; ``granularities`` (K, V scale granularities of
    the cold tier, ``ops.quantization.GRANULARITIES``) is None without one.
    ``static_scales``: ``(K, V)`` page scales ``[num_layers, Hkv, ps|1, D|1]`` (numpy)
    of a calibration (cold pages quantize with them), or None (each page's absmax).
    ``sub_page_size``: tokens per sub-page of two-level selection, 0 without ``key_sub_bounds``.
    ``codecs``: the cold format of each layer (``ops.cold_codec.ColdCodec``; an INT4 package's
    ``int8_layers`` are INT8, ``contracts.cold_tier.TierConfig.layer_codecs``), None without a cold tier.
    """

    num_layers: int
    num_hot: int
    num_cold: int
    num_kv_heads: int
    page_size: int
    head_dim: int
    granularities: tuple[str, str] | None
    codecs: list | None  # ops.cold_codec.ColdCodec per layer
    static_scales: tuple[np.ndarray, np.ndarray] | None
    sub_page_size: int = 0

    @property
    def roles(self) -> tuple[str, ...]:
        """Schema names of the tensors :meth:`cache_inputs` returns."""
        return HOT_ROLES + (COLD_ROLES if self.granularities else ()) + (SUB_ROLES if self.sub_page_size else ())

    def check_sub_page_size(self, sub_page_size: int) -> int:
        """ValueError unless ``sub_page_size`` is 0 or divides the page size (and is smaller)."""
        if not isinstance(sub_page_size, int) or sub_page_size < 0 or (
                sub_page_size and (self.page_size % sub_page_size or sub_page_size == self.page_size)):
            raise ValueError(f"sub_page_size must be 0 or a proper divisor of the page size {self.page_size}, "
                             f"got {sub_page_size!r}")
        return sub_page_size

    def check_range(self, name: str, phys, lo: int, hi: int) -> None:
        """ValueError unless every physical id in ``phys`` is in ``[lo, hi)``."""
        ids = np.asarray(phys).reshape(-1)
        if ids.size and (ids.min() < lo or ids.max() >= hi):
            raise ValueError(f"{name} physical page {int(ids[(ids < lo) | (ids >= hi)][0])} "
                             f"is outside [{lo}, {hi})")

    # ---- what the backend reads ------------------------------------------------
    @abstractmethod
    def cache_inputs(self, layer: int) -> dict:
        """The op's cache tensors of ``layer`` by schema name (:attr:`roles`); views, no copies."""

    @abstractmethod
    def read_page(self, layer: int, page: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(keys [Hkv, ps, D], key_min [Hkv, D], key_max [Hkv, D])`` of physical ``page``
        as host arrays, keys as the op reads them (a cold page dequantized). For checks
        and tests; does not modify the storage."""

    def read_sub_bounds(self, layer: int, page: int) -> np.ndarray:
        """``key_sub_bounds [Hkv, r, D]`` (uint8) of physical ``page`` as a host array (checks, tests)."""
        raise ValueError("these pages keep no sub-page bounds (sub_page_size 0)")

    # ---- data moves the pool asks for ----------------------------------------
    @abstractmethod
    def reset_pages(self, pages: np.ndarray) -> None:
        """Physical ``pages`` were just allocated: key_min = key_max = 0 in every layer
        and their sub-page codes 0 (a storage whose writer rewrites them from a page's first
        token may skip it)."""

    @abstractmethod
    def write_tokens(self, layer: int, slots: np.ndarray, k, v, pages: np.ndarray, valid: np.ndarray) -> None:
        """Write token K/V into hot physical ``slots`` (``page * page_size + offset``,
        ``[tokens]``, no duplicates; ``k, v [tokens, Hkv, D]``), then recompute key
        min/max of the touched ``pages`` over their tokens ``[0, valid)``, then their
        sub-page codes. The pool has checked the slots and computed ``valid`` (``[len(pages)]``)."""

    def write_layers(self, slots: np.ndarray, k, v, pages: np.ndarray, valid: np.ndarray,
                     before: np.ndarray | None = None) -> None:
        """:meth:`write_tokens` into every layer at once: ``k, v [num_layers, tokens, Hkv, D]``,
        ``valid [num_layers, len(pages)]`` (one engine step); ``before``: the pages' valid counts
        before the write, same shape (an implementation may update the bounds of pure appends
        instead of recomputing them). This default writes layer by layer."""
        for layer in range(self.num_layers):
            self.write_tokens(layer, slots, k[layer], v[layer], pages, valid[layer])

    @abstractmethod
    def copy_page(self, src: int, dst: int) -> None:
        """Copy-on-write: physical ``src`` (hot, or cold: dequantized) into hot ``dst``,
        key min/max and sub-page codes included, every layer."""

    @abstractmethod
    def demote_page(self, hot: int, cold: int) -> None:
        """Quantize the full hot page ``hot`` into cold slot ``cold`` (physical ids),
        every layer; the cold page's min/max (and sub-page codes) become those of its
        dequantized keys (INT4: min/max and codes stay, the keys were quantized on them). May be
        deferred until :meth:`flush`."""

    def read_block(self, page: int) -> dict:
        """Hot physical ``page``'s data, every layer, as host arrays (copies) by name: ``k``, ``v``
        ``[L, Hkv, ps, D]``, ``key_min``, ``key_max`` ``[L, Hkv, D]``, ``sub`` ``[L, Hkv, r, D]`` uint8
        or None - a page store's entry (``runtime/kvstore``). Does not modify the storage."""
        raise NotImplementedError(f"{type(self).__name__} cannot export pages to a page store")

    def write_block(self, page: int, block) -> None:
        """Write a :meth:`read_block` of the same geometry (an object with those attributes) into
        hot physical ``page``: its K/V, min/max and sub-page codes, every layer."""
        raise NotImplementedError(f"{type(self).__name__} cannot import pages from a page store")

    def layer_codec(self, layer: int):
        """``layer``'s cold codec (None without a cold tier)."""
        codecs = getattr(self, "codecs", None)
        return None if codecs is None else codecs[layer]

    @property
    def codec(self):
        """The one cold codec of every layer; ValueError when layers differ (use :meth:`layer_codec`)."""
        codecs = getattr(self, "codecs", None)
        if not codecs:
            return None
        if any(c != codecs[0] for c in codecs):
            raise ValueError("the layers' cold formats differ (int8_layers): ask layer_codec(layer)")
        return codecs[0]

    def keys_on_codes(self, layer: int) -> bool:
        """Whether ``layer``'s INT4 cold keys quantize on its sub-page codes (format 3): the layer's op
        node is two-level (reads ``key_sub_bounds``; a package's dense layers' are not, and read the
        page bounds, ``two_level_layers``)."""
        codec = self.layer_codec(layer)
        return bool(self.sub_page_size and codec is not None and codec.keys_on_bounds
                    and layer in self.two_level_layers)

    def refresh_sub_bounds(self, pages: np.ndarray, valid: np.ndarray) -> None:
        """Recompute the sub-page codes of hot physical ``pages`` (``valid [len(pages), ]`` per layer:
        ``[num_layers, len(pages)]``) from their stored keys and min/max: after a backend's append
        kernel wrote tokens and min/max itself (``PagePool.note_device_writes``)."""
        raise ValueError("these pages keep no sub-page bounds (sub_page_size 0)")

    def flush(self) -> None:
        """Finish deferred data moves (nothing is deferred unless an implementation says so)."""
