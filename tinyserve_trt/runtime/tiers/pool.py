"""TieredPagePool: a PagePool whose pages live in a hot float tier or a cold INT8/INT4 tier.

Page ids the scheduler, the prefix cache and sequences hold are *handles*
``[0, num_hot + num_cold)``; each handle in use (or evictable) is bound to one
physical slot, which the op addresses (``schema.INPUTS``):

  hot   physical ids ``[0, P)``           K/V in ``k_pages``/``v_pages`` (pool dtype)
  cold  physical ids ``[P, P + Pcold)``   int8 (or packed int4) in ``k_pages_int8``/``v_pages_int8``,
                                          scales ``[Pcold, Hkv, ps|1, C]`` (INT4 V ``2C``: ``ops.cold_codec``)

The data lives in the pool's ``KVStorage`` (``runtime/kv_storage.py``), which
quantizes on :meth:`TieredPagePool.demote`; this class binds handles to slots.

Why an indirection instead of renumbering on demotion: a handle is referenced
by every sequence's page list, the prefix cache's hash index, an in-flight
batch's page table and the hotness counters. Demotion only rebinds the handle,
so none of them changes and demotion is safe at any time between steps; the
price is one ``np.take`` of the page table per step (:meth:`physical_table`).

Metadata (``key_min``/``key_max`` in the storage, ``num_valid`` here) is indexed
by physical id, the same id as the K/V page, ``Ptot`` rows. A cold INT8 page's min/max are those of
its dequantized keys (what the op attends; see ``docs/op.md``); a cold INT4 page keeps its hot min/max
and sub-page codes, on which its keys were quantized (``ops.cold_codec`` format 3: they contain the
dequantized keys).

New pages are always hot; writes go to hot pages only, and only full pages
are demoted, so a cold page is immutable. :meth:`TieredPagePool.promote` moves a
cold page back into a free hot slot (dequantized; INT8's min/max already describe
those keys, INT4's are recomputed from them: hot metadata is exact). ``hotness.py`` decides which pages to demote and promote; this
class only does it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import replace

import numpy as np

from tinyserve_trt.contracts.cold_tier import TierConfig
from tinyserve_trt.ops.quantization import layer_page_scales
from tinyserve_trt.runtime.config import CacheConfig
from tinyserve_trt.runtime.host_storage import HostKVStorage
from tinyserve_trt.runtime.pages import OutOfPagesError, PagePool, PoolIntegrityError


class TieredPagePool(PagePool):
    """Handles with PagePool's lifecycle (refcounts, LRU, prefix caching) over two tiers.

    ``num_pages`` is the handle count (hot + cold): the scheduler sizes requests by
    it. ``num_available`` counts pages :meth:`allocate` can hand out, which
    also needs hot slots: keep some free by demoting (``hotness.HotnessPolicy``).
    """

    def __init__(self, config: CacheConfig, tiers: TierConfig, num_layers: int, num_kv_heads: int,
                 head_dim: int, static_scales: tuple[np.ndarray, np.ndarray] | None = None,
                 two_level_layers=None):
        hot, cold = config.num_pages, tiers.num_cold_pages
        if (tiers.scales == "static") != (static_scales is not None):
            raise ValueError("TierConfig.scales='static' needs static_scales (a calibration's static_scales()), "
                             "and only it takes them")
        # the calibrated ranges as page scales (K, V): [L, Hkv, ps|1, D|1]
        page_scales = None if static_scales is None else tuple(
            layer_page_scales(arr, gran, num_layers, num_kv_heads, config.page_size, head_dim)
            for arr, gran in zip(static_scales, (tiers.k_granularity, tiers.v_granularity)))
        storage = HostKVStorage(num_layers, hot, num_kv_heads, config.page_size, head_dim, config.dtype,
                                num_cold=cold, static_scales=page_scales, codec=tiers.layer_codecs(num_layers),
                                sub_page_size=config.sub_page_size, two_level_layers=two_level_layers)
        super().__init__(replace(config, num_pages=hot + cold), num_layers, num_kv_heads, head_dim, storage)
        self.config, self.tiers = config, tiers
        self.num_hot, self.num_cold = hot, cold
        self._phys = np.full(hot + cold, -1, np.int64)  # handle -> physical id, -1 unbound
        self._free_hot: deque[int] = deque(range(hot))
        self._free_cold: deque[int] = deque(range(hot, hot + cold))

    # ---- views the op reads (the storage's) ----------------------------------
    def k_pages_int8(self, layer: int):
        """``[num_cold, Hkv, ps, D]`` int8 cold keys of ``layer``."""
        return self.storage.cache_inputs(layer)["key_cache_int8"]

    def v_pages_int8(self, layer: int):
        return self.storage.cache_inputs(layer)["value_cache_int8"]

    def k_scale(self, layer: int):
        """``[num_cold, Hkv, ps|1, D|1]`` float32 dequantization scales of the cold keys."""
        return self.storage.cache_inputs(layer)["key_scale"]

    def v_scale(self, layer: int):
        return self.storage.cache_inputs(layer)["value_scale"]

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

    def allocate(self, n: int = 1, fill=None) -> list[int]:
        """``n`` handles bound to fresh hot slots (metadata reset), refcount 1 each, then
        ``fill(pages)``; one transaction, as :meth:`PagePool.allocate` (undone: handles and
        slots back at the front of their free lists).

        Evicts cached pages LRU when handles or hot slots run short (a hot one
        when slots do). Raises OutOfPagesError, allocating nothing, if impossible.
        """
        if n > self.num_available:
            raise OutOfPagesError(f"need {n} pages, {self.num_free} free handles + {self.num_evictable} "
                                  f"evictable, {self.num_hot_free} free hot slots of {self.num_hot}")
        return super().allocate(n, fill)

    def _take(self, n: int) -> list[int]:
        pages = []
        for _ in range(n):
            if not self._free_hot:
                self._evict(next(p for p in self._evictable if self._phys[p] < self.num_hot))
            if not self._free:
                self._evict(next(iter(self._evictable)))
            page, slot = self._free.popleft(), self._free_hot.popleft()
            self._phys[page] = slot
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def _untake(self, pages: list[int]) -> None:
        for page in reversed(pages):
            self._free_hot.appendleft(int(self._phys[page]))
            self._phys[page] = -1
        super()._untake(pages)

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

    # ---- data ---------------------------------------------------------------
    def _check_copy_target(self, dst: int) -> None:
        """Copies land in a hot page (a cold ``src`` is dequantized by the storage; its
        metadata already describes the dequantized keys)."""
        if not self.is_writable(dst) or not self.is_hot(dst):
            raise ValueError(f"copy target page {dst} is shared, cached or cold")

    def _check_writable(self, pages: np.ndarray) -> None:
        cold = [int(p) for p in np.unique(pages) if not self.is_hot(p) and self._refcount[p] > 0]
        if cold:
            raise ValueError(f"pages {cold} are cold (read-only); copy them to a hot page first")
        super()._check_writable(pages)

    def _physical_ids(self, pages: np.ndarray) -> np.ndarray:
        return self._phys[pages]

    # ---- tiers --------------------------------------------------------------
    def demote(self, page: int) -> tuple[int, int]:
        """Quantize hot page ``page`` into a cold slot and free its hot slot; the handle stays.

        The page must be full in every layer (cold pages are never written). A
        cached unreferenced cold page is evicted (LRU) when no cold slot is free.
        Metadata becomes min/max of the dequantized keys (INT4: min/max and sub-page codes stay). Returns (old, new)
        physical ids. Raises ValueError for a free, cold or partial page and
        OutOfPagesError when the cold tier is full. A storage that raises leaves the pool as it
        was, except that a cold page it had to evict stays evicted.
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
            self._evict(victim)  # stays evicted if the demotion fails: its slot may be overwritten
        new = self._free_cold[0]
        self.storage.demote_page(old, new)  # first: if it raises, no bookkeeping has changed
        self._free_cold.popleft()
        self._num_valid[:, new] = self._num_valid[:, old]
        self._phys[page] = new
        self._free_hot.append(old)
        return old, new

    def promote(self, page: int) -> tuple[int, int]:
        """Dequantize cold page ``page`` into a free hot slot and free its cold slot; the
        handle stays. Never evicts: promotion only uses room there is. Returns (old, new)
        physical ids. Raises ValueError for a free or hot page and OutOfPagesError when no
        hot slot is free. A storage that raises leaves the pool as it was."""
        old = int(self._phys[page])
        if old < 0:
            raise ValueError(f"page {page} is free")
        if old < self.num_hot:
            raise ValueError(f"page {page} is already hot")
        if not self._free_hot:
            raise OutOfPagesError(f"no free hot slot to promote page {page} into")
        new = self._free_hot[0]
        self.storage.copy_page(old, new)  # dequantizes; min/max of the cold page describe these keys
        self._free_hot.popleft()
        self._num_valid[:, new] = self._num_valid[:, old]
        self._phys[page] = new
        self._free_cold.append(old)
        return old, new

    def dequantized_keys(self, layer: int, page: int) -> np.ndarray:
        """``[Hkv, ps, D]`` keys of ``page`` as the op reads them (tests, calibration)."""
        p = int(self._phys[page])
        if p < 0:
            raise ValueError(f"page {page} is free")
        return self.storage.read_page(layer, p)[0]

    # ---- invariant ------------------------------------------------------------
    def _check_layer_formats(self, fail) -> None:
        """Each layer's cold pools are its tier codec's (``TierConfig.layer_codec``: an INT4
        package's ``int8_layers`` INT8): the storage's codec, value dtype and shapes."""
        h, ps, d = self.num_kv_heads, self.page_size, self.head_dim
        for layer in range(self.num_layers):
            want = self.tiers.layer_codec(layer)
            have = self.storage.layer_codec(layer)
            if have != want:
                fail(f"layer {layer} stores {getattr(have, 'cold_format', None)} cold pages, its tier says "
                     f"{want.cold_format} ({self.tiers.describe()})")
            x = self.storage.cache_inputs(layer)
            shapes = {"key_cache_int8": want.pool_shape(h, ps, d), "value_cache_int8": want.pool_shape(h, ps, d),
                      "key_scale": want.scale_shape("k", h, ps, d), "value_scale": want.scale_shape("v", h, ps, d)}
            for role, shape in shapes.items():
                arr = x[role]
                dtype = want.storage_dtype if role.endswith("int8") else want.scale_dtype
                if tuple(arr.shape) != (self.num_cold, *shape) or not _same_dtype(arr, dtype):
                    fail(f"layer {layer}'s {role} is {_dtype_name(arr)} {list(arr.shape)}, its {want.cold_format} "
                         f"codec stores {np.dtype(dtype).name} {[self.num_cold, *shape]}")

    def check_integrity(self, holders: Iterable[Sequence[int]] | None = None, check_data: bool = False) -> None:
        """PagePool's handle invariants, plus: a handle is bound iff in use or evictable,
        bindings are one-to-one, every slot is bound or free exactly once, cold pages
        are full. ``check_data`` also recomputes every bound page's min/max."""
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
        self._check_layer_formats(fail)
        if check_data:
            self._check_minmax()


def _dtype_name(arr) -> str:
    return str(arr.dtype).replace("torch.", "")


def _same_dtype(arr, dtype) -> bool:
    """numpy or torch ``arr`` holds ``dtype`` (a numpy dtype)."""
    return _dtype_name(arr) == np.dtype(dtype).name
