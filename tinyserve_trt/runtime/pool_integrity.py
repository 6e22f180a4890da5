"""The page pool's invariant checks (``PagePool.check_integrity``): page states and refcounts,
and optionally the per-page key min/max and sub-page codes against the stored keys.

Functions of a pool (duck-typed, so this module does not import ``pages``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from tinyserve_trt.ops.fine_bounds import decode, page_sub_bounds


class PoolIntegrityError(RuntimeError):
    """Raised by :meth:`PagePool.check_integrity` with the violated invariant."""


def fail(msg: str):
    raise PoolIntegrityError(f"page pool integrity: {msg}")


def check_states(pool, holders: Iterable[Sequence[int]] | None = None) -> None:
    """Every page in exactly one state (free, in use, evictable) with consistent flags; with
    ``holders``, each page's refcount equals how often holders reference it."""
    n = pool.num_pages
    free = list(pool._free)
    free_set, evict_set = set(free), set(pool._evictable)
    in_use = set(np.flatnonzero(pool._refcount > 0).tolist())
    if len(free_set) != len(free):
        fail("a page is on the free list twice")
    if np.any(pool._refcount < 0):
        fail(f"negative refcount on pages {np.flatnonzero(pool._refcount < 0).tolist()}")
    for a, b, name in ((free_set, in_use, "free and in use"), (evict_set, in_use, "evictable and in use"),
                       (free_set, evict_set, "free and evictable")):
        if a & b:
            fail(f"pages {sorted(a & b)[:10]} are both {name}")
    if len(free_set) + len(evict_set) + len(in_use) != n:
        fail(f"free {len(free_set)} + in use {len(in_use)} + cached {len(evict_set)} != {n}")
    if any(pool._cached[p] for p in free_set):
        fail("a free page is marked cached")
    if not all(pool._cached[p] for p in evict_set):
        fail("an evictable page is not marked cached")
    if holders is not None:
        counts = Counter(p for pages in holders for p in pages)
        expected = np.zeros(n, np.int64)
        for p, c in counts.items():
            if not 0 <= p < n:
                fail(f"a holder references page {p} outside [0, {n})")
            expected[p] = c
        wrong = np.flatnonzero(expected != pool._refcount)
        if wrong.size:
            p = int(wrong[0])
            fail(f"page {p} refcount {pool._refcount[p]} but {expected[p]} holders ({wrong.size} pages wrong)")


def check_bounds(pool) -> None:
    """Every live page's key min/max (and, two-level, sub-page codes) equal a recompute over
    its valid tokens as read back from the storage. A cold INT4 page's keys are quantized on
    its bounds - two-level: on its sub-page codes, kept from the hot page (``ops.cold_codec``
    format 3) -: they must lie inside them, reach key_min exactly, and lie inside their decoded
    sub-page bounds."""
    pool.storage.flush()
    live = np.flatnonzero((pool._refcount > 0) | pool._cached)
    for page, p in zip(live.tolist(), pool._physical_ids(live).tolist()):
        for layer in range(pool.num_layers):
            n = int(pool._num_valid[layer, p])
            if n == 0:
                continue
            keys, kmin, kmax = pool.storage.read_page(layer, p)
            if _keys_on_bounds(pool, p, layer):
                _check_int4_cold_bounds(pool, page, p, layer, keys, kmin, kmax)
                continue
            if not (np.array_equal(keys[:, :n].min(axis=1), kmin) and
                    np.array_equal(keys[:, :n].max(axis=1), kmax)):
                fail(f"page {page} (physical {p}) layer {layer} min/max are stale")
            if pool.storage.sub_page_size and not np.array_equal(
                    pool.storage.read_sub_bounds(layer, p),
                    page_sub_bounds(keys, pool.storage.sub_page_size, kmin, kmax, n)):
                fail(f"page {page} (physical {p}) layer {layer} sub-page bounds are stale")


def _keys_on_bounds(pool, physical: int, layer: int) -> bool:
    """Whether ``layer``'s cold page ``physical`` holds INT4 keys (per-layer codecs: ``int8_layers``)."""
    codec = pool.storage.layer_codec(layer) if hasattr(pool.storage, "layer_codec") else None
    return bool(codec is not None and codec.keys_on_bounds and physical >= getattr(pool, "num_hot", physical + 1))


def _check_int4_cold_bounds(pool, page, p, layer, keys, kmin, kmax) -> None:
    k32 = keys.astype(np.float32)
    lo, hi = kmin.astype(np.float32), kmax.astype(np.float32)
    if not (np.all(k32 >= lo[:, None]) and np.all(k32 <= hi[:, None]) and np.array_equal(k32.min(axis=1), lo)):
        fail(f"cold page {page} (physical {p}) layer {layer} keys leave their bounds")
    if pool.storage.sub_page_size:
        sp = pool.storage.sub_page_size
        sub_lo, sub_hi = decode(pool.storage.read_sub_bounds(layer, p), kmin, kmax)  # [Hkv, r, D]
        k = k32.reshape(k32.shape[0], -1, sp, k32.shape[-1])
        if not (np.all(k >= sub_lo[:, :, None]) and np.all(k <= sub_hi[:, :, None])):
            fail(f"cold page {page} (physical {p}) layer {layer} sub-page bounds do not hold its keys")
