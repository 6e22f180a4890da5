"""PagePool: the owner of KV page ids, their refcounts and valid-token counts.

Every page id is in exactly one state:
  free       refcount 0, not cached      -> on the free list
  in use     refcount > 0                -> held by one or more sequences
  evictable  refcount 0, cached          -> kept for prefix reuse, evicted LRU

The pool moves no data: K/V and the per-page key min/max live in its
:class:`~tinyserve_trt.runtime.kv_storage.KVStorage` (``pool.storage``; numpy
``HostKVStorage`` unless a backend attaches its own with :meth:`attach_storage`),
which the pool asks to write, copy and demote pages by physical id. Per layer,
by physical id (the op schema's names)::

  K, V pools        [num_pages, num_kv_heads, page_size, head_dim]
  key_min, key_max  [num_pages, num_kv_heads, head_dim]  min / max over the page's
                    valid (written) tokens; a fresh page has both = 0.
  key_sub_bounds    [num_pages, num_kv_heads, r, head_dim] uint8, two-level only
                    (``config.sub_page_size``): 4-bit sub-page codes (``ops.fine_bounds``).

Invariant checks: ``pool_integrity.py``. Tiers: here every page is hot and a page id is its physical id. Cold INT8 pages
(issue #6) live in ``tiers.TieredPagePool``, a subclass whose ids are handles
bound to hot or cold slots; the engine reads both through :meth:`physical_table`
and :meth:`cache_inputs`, which are identities here.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from tinyserve_trt.runtime.config import CacheConfig
from tinyserve_trt.runtime.host_storage import HostKVStorage
from tinyserve_trt.runtime.kv_storage import KVStorage
from tinyserve_trt.runtime.pool_integrity import PoolIntegrityError, check_bounds, check_states


class OutOfPagesError(RuntimeError):
    """Raised by :meth:`PagePool.allocate` when free + evictable pages are too few."""


class PagePool:
    """Page ids, refcounts, LRU of cached pages and valid counts over a :class:`KVStorage`.

    storage: where the data lives (default: a numpy ``HostKVStorage`` of this geometry).
    """

    def __init__(self, config: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 storage: KVStorage | None = None):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.config = config
        self.num_pages = n = config.num_pages
        self.page_size = config.page_size
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.storage = storage if storage is not None else HostKVStorage(
            num_layers, n, num_kv_heads, self.page_size, head_dim, config.dtype,
            sub_page_size=config.sub_page_size)
        self._num_valid = np.zeros((num_layers, n), np.int32)  # by physical id; layers are written one by one
        self._refcount = np.zeros(n, np.int32)
        self._cached = np.zeros(n, bool)
        self._free: deque[int] = deque(range(n))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # first = least recently released
        self._on_evict: Callable[[int], None] | None = None

    # ---- views the model reads (the storage's, no copies) -----------------
    def k_pages(self, layer: int):
        """Key pool of ``layer``: ``[num_pages, num_kv_heads, page_size, head_dim]``."""
        return self.storage.cache_inputs(layer)["key_cache"]

    def v_pages(self, layer: int):
        """Value pool of ``layer``: ``[num_pages, num_kv_heads, page_size, head_dim]``."""
        return self.storage.cache_inputs(layer)["value_cache"]

    def key_min(self, layer: int):
        """``[num_pages, num_kv_heads, head_dim]`` elementwise min of each page's valid keys."""
        return self.storage.cache_inputs(layer)["key_min"]

    def key_max(self, layer: int):
        """``[num_pages, num_kv_heads, head_dim]`` elementwise max of each page's valid keys."""
        return self.storage.cache_inputs(layer)["key_max"]

    def num_valid(self, layer: int) -> np.ndarray:
        """``[num_pages]`` tokens written to each page of ``layer`` since it was allocated."""
        return self._num_valid[layer]

    def physical_table(self, page_table: np.ndarray) -> np.ndarray:
        """The op's ``page_table`` for a batch's page ids (int32); ids are physical here."""
        return np.asarray(page_table, np.int32)

    def cache_inputs(self, layer: int) -> dict:
        """The op's cache inputs for ``layer`` by schema name (the storage's views, no copies)."""
        return self.storage.cache_inputs(layer)

    # ---- state ------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Pages :meth:`allocate` can hand out now (free, then evicted LRU)."""
        return len(self._free) + len(self._evictable)

    def refcount(self, page: int) -> int:
        return int(self._refcount[page])

    def is_cached(self, page: int) -> bool:
        return bool(self._cached[page])

    def is_writable(self, page: int) -> bool:
        """True when one holder owns ``page`` and no prefix-cache entry points at it."""
        return self._refcount[page] == 1 and not self._cached[page]

    def set_evict_callback(self, fn: Callable[[int], None] | None) -> None:
        """``fn(page)`` is called when a cached page is evicted to be reused."""
        self._on_evict = fn

    # ---- id lifecycle -----------------------------------------------------
    def allocate(self, n: int = 1, fill: Callable[[list[int]], None] | None = None) -> list[int]:
        """Take ``n`` pages (free first, then evicting cached pages LRU), refcount 1 each.

        Each page's metadata is reset (no valid tokens, key_min = key_max = 0), then
        ``fill(pages)`` runs (e.g. a copy-on-write's :meth:`copy_page`). One transaction:
        if the reset or ``fill`` raises, the pages go back to the front of the free list
        and the pool is as before - except that pages it had to evict stay evicted (their
        data may have been overwritten), now free. Raises OutOfPagesError, allocating
        nothing, when fewer than ``n`` are available.
        """
        if n > self.num_available:
            raise OutOfPagesError(f"need {n} pages, {self.num_free} free + "
                                  f"{self.num_evictable} evictable of {self.num_pages}")
        pages = self._take(n)
        try:
            self._reset(self._physical_ids(np.array(pages, np.int64)))
            if fill is not None:
                fill(pages)
        except BaseException:
            self._untake(pages)
            raise
        return pages

    def _take(self, n: int) -> list[int]:
        """Bookkeeping of :meth:`allocate`: ``n`` pages leave the free list (or the LRU), refcount 1."""
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                self._cached[page] = False
                if self._on_evict is not None:
                    self._on_evict(page)
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def _untake(self, pages: list[int]) -> None:
        """Undo :meth:`_take`: ``pages`` back at the front of the free list, in their order."""
        for page in reversed(pages):
            self._refcount[page] = 0
            self._free.appendleft(page)

    def _reset(self, phys: np.ndarray) -> None:
        """Fresh physical pages: the storage resets their min/max, then no valid tokens
        (in this order, so a storage that raises leaves the valid counts as they were)."""
        self.storage.reset_pages(phys)
        self._num_valid[:, phys] = 0

    def incref(self, page: int) -> None:
        """Add a holder. A cached unreferenced page leaves the LRU; a free page is an error."""
        if self._refcount[page] == 0:
            if page not in self._evictable:
                raise ValueError(f"page {page} is free; allocate it instead of incref")
            del self._evictable[page]
        self._refcount[page] += 1

    def decref(self, page: int) -> None:
        """Drop a holder. At zero a cached page becomes evictable (most recent), else free."""
        if self._refcount[page] <= 0:
            raise ValueError(f"page {page} has no holder to release")
        self._refcount[page] -= 1
        if self._refcount[page] == 0:
            if self._cached[page]:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def mark_cached(self, page: int) -> None:
        """The prefix cache registered ``page`` (in use): keep it when its holders leave."""
        if self._refcount[page] <= 0:
            raise ValueError(f"only an in-use page can be cached; page {page} has refcount 0")
        self._cached[page] = True

    def unmark_cached(self, page: int) -> None:
        """The prefix cache dropped ``page``: an unreferenced one becomes free."""
        self._cached[page] = False
        if page in self._evictable:
            del self._evictable[page]
            self._free.append(page)

    def in_use_pages(self) -> list[int]:
        """Ids of pages with at least one holder."""
        return np.flatnonzero(self._refcount > 0).tolist()

    def cached_pages(self) -> list[int]:
        """Ids of pages the prefix cache registered (in use or evictable)."""
        return np.flatnonzero(self._cached).tolist()

    # ---- data (moved by the storage) ---------------------------------------
    def attach_storage(self, storage: KVStorage) -> None:
        """Keep the page data in ``storage`` from now on (a backend's ``DevicePages``: its
        kernels write tokens there and report them with :meth:`note_device_writes`).
        Only an empty pool (no page in use or cached) swaps storage: nothing is copied."""
        if np.any(self._refcount > 0) or np.any(self._cached):
            raise ValueError("attach storage to an empty pool: pages in use would lose their data")
        want = (self.num_layers, self.num_kv_heads, self.page_size, self.head_dim, self.storage.num_hot,
                self.storage.num_cold, self.storage.sub_page_size)
        # over a pool without a cold tier a device storage may hold one unused cold page
        # (the op's _int8 overload needs one); page ids never reach it
        got = (storage.num_layers, storage.num_kv_heads, storage.page_size, storage.head_dim, storage.num_hot,
               storage.num_cold if self.storage.num_cold else 0, storage.sub_page_size)
        if got != want:
            raise ValueError(f"storage geometry (layers, heads, page size, head dim, hot, cold, sub-page) {got} "
                             f"does not match the pool's {want}")
        self.storage = storage

    def copy_page(self, src: int, dst: int) -> None:
        """Copy K, V, key_min/key_max and valid counts of ``src`` into ``dst``, all layers.

        ``dst`` must be writable (copy-on-write target); ``src`` must be in use.
        """
        if self._refcount[src] <= 0:
            raise ValueError(f"copy source page {src} is not in use")
        self._check_copy_target(dst)
        s, t = (int(p) for p in self._physical_ids(np.array([src, dst])))
        self.storage.copy_page(s, t)
        self._num_valid[:, t] = self._num_valid[:, s]

    def _check_copy_target(self, dst: int) -> None:
        if not self.is_writable(dst):
            raise ValueError(f"copy target page {dst} is shared or cached")

    def write_tokens(self, layer: int, slots: np.ndarray, k, v) -> None:
        """Write token K/V into ``layer``; the storage updates key_min/key_max of the touched pages.

        slots: ``[tokens]`` int, ``page * page_size + offset``; no duplicates.
        k, v:  ``[tokens, num_kv_heads, head_dim]``.
        Each touched page must be writable, and after the write its tokens
        ``[0, valid)`` must all have been written (appends or overwrites, no gap).
        Min/max are recomputed from the stored keys of the valid tokens, so they
        are exact (in the pool dtype) whatever the write order.
        """
        slots = np.asarray(slots, np.int64).reshape(-1)
        shape = (slots.shape[0], self.num_kv_heads, self.head_dim)
        if k.shape != shape or v.shape != shape:
            raise ValueError(f"k and v must be {shape} for {shape[0]} slots, got {k.shape} and {v.shape}")
        plan = self._write_plan(slots, layer)
        if plan is not None:
            phys, upages, new = plan
            self.storage.write_tokens(layer, phys, k, v, upages, new[0])
            self._num_valid[layer, upages] = new[0]

    def write_step(self, slot_mapping: np.ndarray, keys: Sequence[np.ndarray] | np.ndarray,
                   values: Sequence[np.ndarray] | np.ndarray) -> None:
        """:meth:`write_batch` of every layer in one call (``keys``/``values``: one array per
        layer, or one ``[layers, batch, kv_heads, new, head_dim]`` array - the backend's outputs
        bound into one buffer - which is read without stacking): the page checks run once and
        the storage writes all layers together."""
        slot_mapping = np.asarray(slot_mapping)
        b, t = slot_mapping.shape
        want = (b, self.num_kv_heads, t, self.head_dim)
        stacked = all(isinstance(x, np.ndarray) and x.shape == (self.num_layers, *want) for x in (keys, values))
        if not stacked and (len(keys) != self.num_layers or len(values) != self.num_layers or any(
                x.shape != want for x in (*keys, *values))):
            raise ValueError(f"keys/values must be {self.num_layers} layers of {want} for slot_mapping "
                             f"{slot_mapping.shape}")
        keep = slot_mapping >= 0
        plan = self._write_plan(slot_mapping[keep].astype(np.int64), slice(None))
        if plan is None:
            return
        phys, upages, new = plan
        if stacked:  # one gather per array: [L, B, T, Hkv, D][:, keep] -> [L, tokens, Hkv, D]
            k_tok, v_tok = np.swapaxes(keys, 2, 3)[:, keep], np.swapaxes(values, 2, 3)[:, keep]
        else:
            k_tok = np.stack([np.swapaxes(k, 1, 2)[keep] for k in keys])  # [L, tokens, Hkv, D]
            v_tok = np.stack([np.swapaxes(v, 1, 2)[keep] for v in values])
        self.storage.write_layers(phys, k_tok, v_tok, upages, new, before=self._num_valid[:, upages])
        self._num_valid[:, upages] = new

    def _write_plan(self, slots: np.ndarray, layer) -> tuple | None:
        """Checks of a write of ``slots`` into ``layer`` (an index or ``slice(None)``: every layer);
        ``(physical slots, touched physical pages, their valid counts after [layers, pages])``,
        None for no tokens. ValueError for a bad slot, a page not writable or a gap."""
        if slots.size and (slots.min() < 0 or slots.max() >= self.num_pages * self.page_size):
            raise ValueError(f"slot out of range [0, {self.num_pages * self.page_size})")
        self._check_writable(slots // self.page_size)
        n_tok = slots.shape[0]
        if n_tok == 0:
            return None
        phys = self._physical_ids(slots // self.page_size) * self.page_size + slots % self.page_size
        pages, offs = phys // self.page_size, phys % self.page_size
        upages, inv = np.unique(pages, return_inverse=True)
        old = self._num_valid[layer, upages].reshape(-1, upages.shape[0])  # [layers, U]
        if upages.shape[0] == n_tok:  # a token a page (a decode step): no duplicates; a gap iff past the count
            off = np.empty_like(offs)
            off[inv] = offs
            if np.any(off > old):
                raise ValueError("write leaves a gap of unwritten tokens inside a page")
            return phys, upages, np.maximum(old, off + 1)
        if np.unique(slots).shape[0] != n_tok:
            raise ValueError("duplicate slots in one write")
        last = np.full(upages.shape, -1, np.int64)
        np.maximum.at(last, inv, offs)
        new = np.maximum(old, last + 1)
        in_page = (inv[:, None] == np.arange(upages.shape[0])).astype(np.int64)  # [tokens, U]
        appended = (offs >= old[:, inv]).astype(np.int64) @ in_page  # per layer, tokens past the old count
        if np.any(appended != new - old):
            raise ValueError("write leaves a gap of unwritten tokens inside a page")
        return phys, upages, new

    def note_device_writes(self, slot_mapping: np.ndarray) -> None:
        """Valid counts after a backend wrote a step's tokens (``slot_mapping``:
        ``[batch, new]`` page * page_size + offset, -1 padding) into every layer's
        pages in its attached storage itself (an append kernel, which also refreshes
        their min/max; a two-level storage then recomputes those pages' sub-page codes).
        The same page checks as :meth:`write_tokens`."""
        slots = np.asarray(slot_mapping, np.int64).reshape(-1)
        slots = slots[slots >= 0]
        if not slots.size:
            return
        if slots.max() >= self.num_pages * self.page_size:
            raise ValueError(f"slot out of range [0, {self.num_pages * self.page_size})")
        self._check_writable(slots // self.page_size)
        phys = self._physical_ids(slots // self.page_size)
        upages, inv = np.unique(phys, return_inverse=True)
        last = np.full(upages.shape, -1, np.int64)
        np.maximum.at(last, inv, slots % self.page_size)
        self._num_valid[:, upages] = np.maximum(self._num_valid[:, upages], last + 1)
        if self.storage.sub_page_size:
            self.storage.refresh_sub_bounds(upages, self._num_valid[:, upages])

    def _check_writable(self, pages: np.ndarray) -> None:
        bad = [int(p) for p in np.unique(pages) if not self.is_writable(p)]
        if bad:
            raise ValueError(f"pages {bad} are free, shared or cached; copy-on-write first")

    def _physical_ids(self, pages: np.ndarray) -> np.ndarray:
        """Storage ids of page ids (identity here; handles -> slots in a tiered pool)."""
        return pages

    def write_batch(self, layer: int, slot_mapping: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Write a step's new K/V as the model returns them.

        slot_mapping: ``[batch, new_tokens]`` int, -1 for padding (``ScheduledBatch.slot_mapping``).
        k, v:         ``[batch, num_kv_heads, new_tokens, head_dim]``.
        """
        slot_mapping = np.asarray(slot_mapping)
        b, t = slot_mapping.shape
        if k.shape[0] != b or k.shape[2] != t or k.shape != v.shape:
            raise ValueError(f"k/v {k.shape}/{v.shape} do not match slot_mapping {slot_mapping.shape}")
        keep = slot_mapping >= 0
        k_tok = np.swapaxes(k, 1, 2)[keep]  # [tokens, Hkv, D]
        v_tok = np.swapaxes(v, 1, 2)[keep]
        self.write_tokens(layer, slot_mapping[keep], k_tok, v_tok)

    # ---- invariant --------------------------------------------------------
    def check_integrity(self, holders: Iterable[Sequence[int]] | None = None, check_data: bool = False) -> None:
        """Raise PoolIntegrityError unless every page is in exactly one state.

        Checks free + in use + evictable == num_pages with no overlap, the
        free/evictable pages' flags, and, when ``holders`` (each holder's page
        list, e.g. every live sequence's page table) is given, that each page's
        refcount equals the number of times holders reference it. ``check_data``
        also reads every live page back from the storage and recomputes its
        key min/max over its valid tokens (and, two-level, its sub-page codes).
        See ``pool_integrity.py``.
        """
        check_states(self, holders)
        if check_data:
            self._check_minmax()

    def _check_minmax(self) -> None:
        check_bounds(self)
