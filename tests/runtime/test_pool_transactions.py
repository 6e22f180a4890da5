"""Page-pool operations are transactions (issue #29, STYLE principle 5): when the storage
raises inside allocate (reset, fill), demote or promote, the pool is as it was -
``check_integrity`` passes, free lists, LRU, refcounts, bindings and live data unchanged.

The one documented exception: a cached page the operation had to evict to make room
stays evicted (now free), since the failed data move may have overwritten its slot.
"""

from __future__ import annotations

import numpy as np
import pytest

from tinyserve_trt.runtime.config import CacheConfig
from tinyserve_trt.runtime.pages import PagePool
from tinyserve_trt.runtime.tiers import TierConfig, TieredPagePool

from tests.runtime.storage_faults import InjectedFault, flaky, pool_state

PS, L, H, D = 4, 2, 2, 8
WHEN = ["before", "after"]


def write(pool, page, rng, n=PS):
    for layer in range(L):
        k = rng.standard_normal((n, H, D)).astype(np.float32)
        pool.write_tokens(layer, page * PS + np.arange(n), k, -k)


def flat_pool(num_pages=6):
    return PagePool(CacheConfig(page_size=PS, num_pages=num_pages, dtype="float32"), L, H, D)


def tiered_pool(hot=4, cold=3):
    return TieredPagePool(CacheConfig(page_size=PS, num_pages=hot, dtype="float32"),
                          TierConfig(num_cold_pages=cold), L, H, D)


def populated(pool, rng):
    """Two pages held by one sequence, one cached page nobody holds (evictable)."""
    a, b, c = pool.allocate(3)
    for p in (a, b, c):
        write(pool, p, rng)
    pool.mark_cached(c)
    pool.decref(c)
    return [[a, b]]


@pytest.mark.parametrize("make", [flat_pool, tiered_pool], ids=["flat", "tiered"])
@pytest.mark.parametrize("when", WHEN)
def test_a_failed_reset_undoes_the_allocation(make, when):
    pool, rng = make(), np.random.default_rng(0)
    holders = populated(pool, rng)
    before = pool_state(pool)
    storage = flaky(pool)
    storage.arm("reset_pages", when)
    with pytest.raises(InjectedFault):
        pool.allocate(1)  # a free page: no eviction needed
    pool.check_integrity(holders, check_data=True)
    assert pool_state(pool) == before
    (page,) = pool.allocate(1)  # and the pool still allocates
    assert page == before["free"][0]
    pool.check_integrity(holders + [[page]], check_data=True)


@pytest.mark.parametrize("make", [flat_pool, tiered_pool], ids=["flat", "tiered"])
def test_a_failed_fill_undoes_the_allocation(make):
    pool, rng = make(), np.random.default_rng(0)
    holders = populated(pool, rng)
    before = pool_state(pool)
    got = []

    def fill(pages):
        got.extend(pages)
        raise InjectedFault("injected fill failure")

    with pytest.raises(InjectedFault):
        pool.allocate(1, fill=fill)
    assert got == before["free"][:1]
    pool.check_integrity(holders, check_data=True)
    assert pool_state(pool) == before


@pytest.mark.parametrize("make", [flat_pool, tiered_pool], ids=["flat", "tiered"])
@pytest.mark.parametrize("when", WHEN)
def test_a_failed_copy_on_write_undoes_its_allocation(make, when):
    pool, rng = make(), np.random.default_rng(0)
    holders = populated(pool, rng)
    src = holders[0][0]
    pool.incref(src)  # shared: a writer must copy it
    holders.append([src])
    before = pool_state(pool)
    storage = flaky(pool)
    storage.arm("copy_page", when)
    with pytest.raises(InjectedFault):
        pool.allocate(1, fill=lambda pages: pool.copy_page(src, pages[0]))
    pool.check_integrity(holders, check_data=True)
    assert pool_state(pool) == before and pool.refcount(src) == 2


@pytest.mark.parametrize("make", [flat_pool, tiered_pool], ids=["flat", "tiered"])
def test_a_failed_reset_after_an_eviction_keeps_only_the_eviction(make):
    pool, rng = make(), np.random.default_rng(0)
    holders = populated(pool, rng)
    (cached,) = list(pool._evictable)
    evicted = []
    pool.set_evict_callback(evicted.append)
    n = pool.num_available
    before = pool_state(pool)
    storage = flaky(pool)
    storage.arm("reset_pages", "after")  # the evicted page's bounds are gone: it must not stay cached
    with pytest.raises(InjectedFault):
        pool.allocate(n)
    pool.check_integrity(holders, check_data=True)
    after = pool_state(pool)
    assert evicted == [cached] and not pool.is_cached(cached) and pool.num_evictable == 0
    assert pool.num_available == n and after["refcount"] == before["refcount"]
    assert sorted(after["free"]) == sorted(before["free"] + [cached])
    assert {p: d for p, d in after["data"].items()} == {p: d for p, d in before["data"].items() if p != cached}


@pytest.mark.parametrize("when", WHEN)
def test_a_failed_demotion_leaves_the_page_hot(when):
    pool, rng = tiered_pool(), np.random.default_rng(0)
    holders = populated(pool, rng)
    page = holders[0][0]
    before = pool_state(pool)
    storage = flaky(pool)
    storage.arm("demote_page", when)
    with pytest.raises(InjectedFault):
        pool.demote(page)
    pool.check_integrity(holders, check_data=True)
    assert pool_state(pool) == before and pool.is_hot(page)
    _, new = pool.demote(page)  # and it demotes on the next try, into the same slot
    assert new == before["free_cold"][0]
    pool.check_integrity(holders, check_data=True)


def test_a_failed_demotion_into_an_evicted_cold_slot_keeps_only_the_eviction():
    pool, rng = tiered_pool(hot=4, cold=1), np.random.default_rng(0)
    holders = populated(pool, rng)
    (cached,) = list(pool._evictable)
    pool.demote(cached)  # the only cold slot holds the cached page
    before = pool_state(pool)
    storage = flaky(pool)
    storage.arm("demote_page", "after")
    with pytest.raises(InjectedFault):
        pool.demote(holders[0][0])
    pool.check_integrity(holders, check_data=True)
    after = pool_state(pool)
    assert not pool.is_cached(cached) and pool.physical(cached) == -1 and pool.num_cold_free == 1
    assert after["refcount"] == before["refcount"] and pool.is_hot(holders[0][0])
    assert after["data"] == {p: d for p, d in before["data"].items() if p != cached}


@pytest.mark.parametrize("when", WHEN)
def test_a_failed_promotion_leaves_the_page_cold(when):
    pool, rng = tiered_pool(), np.random.default_rng(0)
    holders = populated(pool, rng)
    page = holders[0][0]
    pool.demote(page)
    before = pool_state(pool)
    storage = flaky(pool)
    storage.arm("copy_page", when)
    with pytest.raises(InjectedFault):
        pool.promote(page)
    pool.check_integrity(holders, check_data=True)
    assert pool_state(pool) == before and not pool.is_hot(page)
    _, new = pool.promote(page)
    assert new == before["free_hot"][0]
    pool.check_integrity(holders, check_data=True)
