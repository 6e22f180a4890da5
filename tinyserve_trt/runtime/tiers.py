"""TieredPagePool: a PagePool whose pages live in a hot float tier or a cold INT8 tier.

Page ids the scheduler, the prefix cache and sequences hold are *handles*
``[0, num_hot + num_cold)``; each handle in use (or evictable) is bound to one
physical slot, which the op addresses (``schema.INPUTS``):

  hot   physical ids ``[0, P)``           K/V in ``k_pages``/``v_pages`` (pool dtype)
  cold  physical ids ``[P, P + Pcold)``   int8 in ``k_pages_int8``/``v_pages_int8``,
                                          float32 scales ``[Pcold, Hkv, ps|1, D|1]``

Why an indirection instead of renumbering on demotion: a handle is referenced
by every sequence's page list, the prefix cache's hash index, an in-flight
batch's page table and the hotness counters. Demotion only rebinds the handle,
so none of them changes and demotion is safe at any time between steps; the
price is one ``np.take`` of the page table per step (:meth:`physical_table`).

Metadata (``key_min``/``key_max``/``num_valid``) is indexed by physical id, the
same id as the K/V page, ``Ptot`` rows. A cold page's min/max are those of its
dequantized keys (what the op attends; see ``docs/op.md``).

New pages are always hot; writes go to hot pages only, and only full pages
are demoted, so a cold page is immutable. ``hotness.py`` decides which pages
to demote; this class only does it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import replace

import numpy as np

from tinyserve_trt.contracts.cold_tier import TierConfig
from tinyserve_trt.ops.quantization import (bytes_per_page, dequantize_page, layer_page_scales,
                                            quantize_page, quantize_page_static, scale_shape)
from tinyserve_trt.runtime.config import CacheConfig
from tinyserve_trt.runtime.pages import OutOfPagesError, PagePool, PoolIntegrityError


def cold_page_bytes(tiers: TierConfig, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                    dtype: str = "float16") -> int:
    """Bytes one cold page costs over all layers: int8 K/V, their float32 scales, and
    key_min/key_max in ``dtype`` (compare ``CacheConfig.page_bytes`` for a hot page)."""
    kv = sum(bytes_per_page(g, num_kv_heads, page_size, head_dim) for g in (tiers.k_granularity,
                                                                            tiers.v_granularity))
    return num_layers * (kv + 2 * num_kv_heads * head_dim * np.dtype(dtype).itemsize)


class TieredPagePool(PagePool):
    """Handles with PagePool's lifecycle (refcounts, LRU, prefix caching) over two tiers.

    ``num_pages`` is the handle count (hot + cold): the scheduler sizes requests by
    it. ``num_available`` counts pages :meth:`allocate` can hand out, which
    also needs hot slots: keep some free by demoting (``hotness.HotnessPolicy``).
    """

    def __init__(self, config: CacheConfig, tiers: TierConfig, num_layers: int, num_kv_heads: int,
                 head_dim: int, static_scales: tuple[np.ndarray, np.ndarray] | None = None):
        hot, cold = config.num_pages, tiers.num_cold_pages
        # The base sets up handle bookkeeping and Ptot-row metadata; its float K/V
        # arrays (np.zeros: never touched, so never resident) are replaced below.
        super().__init__(replace(config, num_pages=hot + cold), num_layers, num_kv_heads, head_dim)
        self.config, self.tiers = config, tiers
        self.num_hot, self.num_cold = hot, cold
        dtype = np.dtype(config.dtype)
        L, h, p, d = num_layers, num_kv_heads, self.page_size, head_dim
        self._k = np.zeros((L, hot, h, p, d), dtype)
        self._v = np.zeros((L, hot, h, p, d), dtype)
        self._kq = np.zeros((L, cold, h, p, d), np.int8)
        self._vq = np.zeros((L, cold, h, p, d), np.int8)
        self._ks = np.ones((L, cold) + scale_shape(tiers.k_granularity, h, p, d), np.float32)
        self._vs = np.ones((L, cold) + scale_shape(tiers.v_granularity, h, p, d), np.float32)
        self._phys = np.full(hot + cold, -1, np.int64)  # handle -> physical id, -1 unbound
        self._free_hot: deque[int] = deque(range(hot))
        self._free_cold: deque[int] = deque(range(hot, hot + cold))
        if (tiers.scales == "static") != (static_scales is not None):
            raise ValueError("TierConfig.scales='static' needs static_scales (a calibration's static_scales()), "
                             "and only it takes them")
        # per layer, the page scales of the calibrated ranges (K, V): [L, Hkv, ps|1, D|1]
        self.static_scales = None if static_scales is None else tuple(
            layer_page_scales(arr, gran, num_layers, num_kv_heads, self.page_size, head_dim)
            for arr, gran in zip(static_scales, (tiers.k_granularity, tiers.v_granularity)))


    # ---- views the op reads ------------------------------------------------
    def k_pages_int8(self, layer: int) -> np.ndarray:
        """``[num_cold, Hkv, ps, D]`` int8 cold keys of ``layer``."""
        return self._kq[layer]

    def v_pages_int8(self, layer: int) -> np.ndarray:
        return self._vq[layer]

    def k_scale(self, layer: int) -> np.ndarray:
        """``[num_cold, Hkv, ps|1, D|1]`` float32 dequantization scales of the cold keys."""
        return self._ks[layer]

    def v_scale(self, layer: int) -> np.ndarray:
        return self._vs[layer]

    def physical(self, page: int) -> int:
        """Physical id of handle ``page`` (hot ``< num_hot``, else cold); -1 when free."""
        return int(self._phys[page])

    def is_hot(self, page: int) -> bool:
        return 0 <= self._phys[page] < self.num_hot

    def is_full(self, page: int) -> bool:
        """True when ``page`` is bound and all its tokens are written in every layer."""
        p = self._phys[page]
        return bool(p >= 0 and np.all(self._num_valid[:, p] == self.page_size))

    def physical_table(self, page_table: np.ndarray) -> np.ndarray:
        """The op's ``page_table``: handles -> physical ids, int32. Unbound handles
        (page-table padding) map to 0, a valid id the op never reads."""
        phys = self._phys[np.asarray(page_table, np.int64)]
        return np.where(phys < 0, 0, phys).astype(np.int32)

    def cache_inputs(self, layer: int) -> dict[str, np.ndarray]:
        """The op's cache inputs for ``layer`` by schema name (views, no copies)."""
        return dict(key_cache=self._k[layer], value_cache=self._v[layer], key_min=self._key_min[layer],
                    key_max=self._key_max[layer], key_cache_int8=self._kq[layer],
                    value_cache_int8=self._vq[layer], key_scale=self._ks[layer], value_scale=self._vs[layer])

    @property
    def num_hot_free(self) -> int:
        return len(self._free_hot)

    @property
    def num_cold_free(self) -> int:
        return len(self._free_cold)

    def hot_pages(self) -> list[int]:
        """Handles bound to hot slots (in use or evictable)."""
        return np.flatnonzero((self._phys >= 0) & (self._phys < self.num_hot)).tolist()

    def cold_pages(self) -> list[int]:
        return np.flatnonzero(self._phys >= self.num_hot).tolist()

    # ---- lifecycle: PagePool's, plus slot binding ---------------------------
    @property
    def num_available(self) -> int:
        """Each allocation takes a handle and a hot slot; evicting a hot cached page yields both."""
        hot_evictable = sum(1 for p in self._evictable if self._phys[p] < self.num_hot)
        return min(len(self._free) + len(self._evictable), len(self._free_hot) + hot_evictable)

    def allocate(self, n: int = 1) -> list[int]:
        """``n`` handles bound to fresh hot slots (metadata reset), refcount 1 each.

        Evicts cached pages LRU when handles or hot slots run short (a hot one
        when slots do). Raises OutOfPagesError, allocating nothing, if impossible.
        """
        if n > self.num_available:
            raise OutOfPagesError(f"need {n} pages, {self.num_free} free handles + {self.num_evictable} "
                                  f"evictable, {self.num_hot_free} free hot slots of {self.num_hot}")
        pages = []
        for _ in range(n):
            if not self._free_hot:
                self._evict(next(p for p in self._evictable if self._phys[p] < self.num_hot))
            if not self._free:
                self._evict(next(iter(self._evictable)))
            page, slot = self._free.popleft(), self._free_hot.popleft()
            self._phys[page] = slot
            self._refcount[page] = 1
            self._reset_slot(slot)
            pages.append(page)
        return pages

    def decref(self, page: int) -> None:
        super().decref(page)
        if self._refcount[page] == 0 and not self._cached[page]:
            self._unbind(page)

    def unmark_cached(self, page: int) -> None:
        super().unmark_cached(page)
        if self._refcount[page] == 0:
            self._unbind(page)

    def _evict(self, page: int) -> None:
        del self._evictable[page]
        self._cached[page] = False
        if self._on_evict is not None:
            self._on_evict(page)
        self._unbind(page)
        self._free.append(page)

    def _unbind(self, page: int) -> None:
        slot = int(self._phys[page])
        self._phys[page] = -1
        (self._free_hot if slot < self.num_hot else self._free_cold).append(slot)

    def _reset_slot(self, slot: int) -> None:
        self._num_valid[:, slot] = 0
        self._key_min[:, slot] = 0
        self._key_max[:, slot] = 0

    # ---- data ---------------------------------------------------------------
    def copy_page(self, src: int, dst: int) -> None:
        """Copy ``src`` into the hot page ``dst`` (copy-on-write target), all layers.
        A cold ``src`` is dequantized; its metadata already describes the dequantized keys."""
        if self._refcount[src] <= 0:
            raise ValueError(f"copy source page {src} is not in use")
        if not self.is_writable(dst) or not self.is_hot(dst):
            raise ValueError(f"copy target page {dst} is shared, cached or cold")
        s, t = int(self._phys[src]), int(self._phys[dst])
        if self._device is not None:
            self._device.copy_page(s, t)
        elif s < self.num_hot:
            self._k[:, t], self._v[:, t] = self._k[:, s], self._v[:, s]
        else:
            c = s - self.num_hot
            for layer in range(self.num_layers):
                self._k[layer, t] = dequantize_page(self._kq[layer, c], self._ks[layer, c], self._k.dtype)
                self._v[layer, t] = dequantize_page(self._vq[layer, c], self._vs[layer, c], self._v.dtype)
        for arr in (self._key_min, self._key_max, self._num_valid):
            arr[:, t] = arr[:, s]

    def write_tokens(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """As :meth:`PagePool.write_tokens`; ``slots`` are ``handle * page_size + offset``
        and every touched page must be writable and hot."""
        slots = np.asarray(slots, np.int64).reshape(-1)
        if slots.size and (slots.min() < 0 or slots.max() >= self.num_pages * self.page_size):
            raise ValueError(f"slot out of range [0, {self.num_pages * self.page_size})")
        handles = slots // self.page_size
        self._check_writable(handles)
        if self._device is not None:
            raise ValueError("page data lives on the backend's device (attach_device); use note_device_writes")
        phys_slots = self._phys[handles] * self.page_size + slots % self.page_size
        self._write_physical(layer, phys_slots, k, v)

    def _check_writable(self, pages: np.ndarray) -> None:
        cold = [int(p) for p in np.unique(pages) if not self.is_hot(p) and self._refcount[p] > 0]
        if cold:
            raise ValueError(f"pages {cold} are cold (read-only); copy them to a hot page first")
        super()._check_writable(pages)

    def _physical_ids(self, pages: np.ndarray) -> np.ndarray:
        return self._phys[pages]

    def _update_minmax(self, layer, phys_ids, keys, valid):
        mask = (np.arange(self.page_size)[None, :] < np.asarray(valid)[:, None])[:, None, :, None]
        big = np.array(np.inf, keys.dtype)
        self._key_min[layer, phys_ids] = np.where(mask, keys, big).min(axis=2)
        self._key_max[layer, phys_ids] = np.where(mask, keys, -big).max(axis=2)

    # ---- tiers --------------------------------------------------------------
    def demote(self, page: int) -> tuple[int, int]:
        """Quantize hot page ``page`` into a cold slot and free its hot slot; the handle stays.

        The page must be full in every layer (cold pages are never written). A
        cached unreferenced cold page is evicted (LRU) when no cold slot is free.
        Metadata becomes min/max of the dequantized keys. Returns (old, new)
        physical ids. Raises ValueError for a free, cold or partial page and
        OutOfPagesError when the cold tier is full.
        """
        old = int(self._phys[page])
        if old < 0:
            raise ValueError(f"page {page} is free")
        if old >= self.num_hot:
            raise ValueError(f"page {page} is already cold")
        if np.any(self._num_valid[:, old] != self.page_size):
            raise ValueError(f"page {page} is not full in every layer; only full pages are demoted")
        if not self._free_cold:
            victim = next((p for p in self._evictable if self._phys[p] >= self.num_hot), None)
            if victim is None:
                raise OutOfPagesError(f"cold tier full ({self.num_cold} pages, none evictable)")
            self._evict(victim)
        new = self._free_cold.popleft()
        if self._device is not None:
            self._device.demote_page(old, new)
        else:
            self._quantize_slot(old, new)
        self._num_valid[:, new] = self._num_valid[:, old]
        self._phys[page] = new
        self._free_hot.append(old)
        return old, new

    def _quantize_slot(self, old: int, new: int) -> None:
        """Hot slot ``old`` into cold slot ``new`` (host arrays), every layer."""
        c = new - self.num_hot
        kg, vg = self.tiers.k_granularity, self.tiers.v_granularity
        for layer in range(self.num_layers):
            if self.static_scales is not None:
                ks, vs = (s[layer] for s in self.static_scales)
                self._kq[layer, c], self._ks[layer, c] = quantize_page_static(self._k[layer, old], ks)
                self._vq[layer, c], self._vs[layer, c] = quantize_page_static(self._v[layer, old], vs)
            else:
                self._kq[layer, c], self._ks[layer, c] = quantize_page(self._k[layer, old], kg)
                self._vq[layer, c], self._vs[layer, c] = quantize_page(self._v[layer, old], vg)
            deq = dequantize_page(self._kq[layer, c], self._ks[layer, c], self._k.dtype)
            self._update_minmax(layer, [new], deq[None], [self.page_size])

    def dequantized_keys(self, layer: int, page: int) -> np.ndarray:
        """``[Hkv, ps, D]`` keys of ``page`` as the op reads them (tests, calibration)."""
        p = int(self._phys[page])
        if p < 0:
            raise ValueError(f"page {page} is free")
        if p < self.num_hot:
            return self._k[layer, p]
        c = p - self.num_hot
        return dequantize_page(self._kq[layer, c], self._ks[layer, c], self._k.dtype)

    # ---- invariant ------------------------------------------------------------
    def check_integrity(self, holders: Iterable[Sequence[int]] | None = None, check_data: bool = False) -> None:
        """PagePool's handle invariants, plus: a handle is bound iff in use or evictable,
        bindings are one-to-one, every slot is bound or free exactly once, cold pages
        are full. ``check_data`` also recomputes every bound page's min/max."""
        if check_data and self._device is not None:
            raise ValueError("check_data reads page data, which lives on the backend's device")
        super().check_integrity(holders)

        def fail(msg: str):
            raise PoolIntegrityError(f"tiered pool integrity: {msg}")

        live = (self._refcount > 0) | self._cached
        bound = self._phys >= 0
        if np.any(live != bound):
            p = int(np.flatnonzero(live != bound)[0])
            fail(f"page {p} is {'live' if live[p] else 'free'} but {'un' if not bound[p] else ''}bound")
        slots = self._phys[bound]
        if np.unique(slots).size != slots.size:
            fail("two handles share a physical slot")
        for name, free, lo, hi in (("hot", self._free_hot, 0, self.num_hot),
                                   ("cold", self._free_cold, self.num_hot, self.num_hot + self.num_cold)):
            used = slots[(slots >= lo) & (slots < hi)]
            free_set = set(free)
            if len(free_set) != len(free) or any(not lo <= s < hi for s in free):
                fail(f"{name} free list has duplicates or foreign slots")
            if free_set & set(used.tolist()):
                fail(f"a {name} slot is both free and bound")
            if len(free_set) + used.size != hi - lo:
                fail(f"{name} slots: {len(free_set)} free + {used.size} bound != {hi - lo}")
        cold_slots = slots[slots >= self.num_hot]
        if np.any(self._num_valid[:, cold_slots] != self.page_size):
            fail("a cold page is not full")
        if check_data:
            for page in np.flatnonzero(bound):
                p = int(self._phys[page])
                for layer in range(self.num_layers):
                    n = int(self._num_valid[layer, p])
                    if n == 0:
                        continue
                    keys = self.dequantized_keys(layer, int(page))[:, :n]
                    if not (np.array_equal(keys.min(axis=1), self._key_min[layer, p])
                            and np.array_equal(keys.max(axis=1), self._key_max[layer, p])):
                        fail(f"page {page} (physical {p}) layer {layer} min/max are stale")
