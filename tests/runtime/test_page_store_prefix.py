"""The prefix cache over a page store (issue #33), on a bare pool: evicted pages go to the store
and come back bit for bit; a failing store or restore costs only the reuse."""

from __future__ import annotations

import numpy as np
import pytest

from tinyserve_trt.runtime.config import CacheConfig
from tinyserve_trt.runtime.kvstore import StoreIdentity, make_page_store
from tinyserve_trt.runtime.pages import PagePool
from tinyserve_trt.runtime.prefix_cache import make_prefix_cache

L, HKV, D, PS = 2, 1, 2, 4


def setup(num_pages=4, sub=0, store_bytes=1 << 20):
    pool = PagePool(CacheConfig(page_size=PS, num_pages=num_pages, dtype="float32", sub_page_size=sub), L, HKV, D)
    ident = StoreIdentity(package="t", num_layers=L, num_kv_heads=HKV, page_size=PS, head_dim=D, dtype="float32",
                          sub_page_size=sub)
    store = make_page_store("host", ident, host_bytes=store_bytes)
    return pool, make_prefix_cache("hash", pool, store=store), store


def compute(pool, cache, tokens, seed):
    """A sequence that computed ``tokens`` (random K/V written), released: its pages stay cached."""
    rng = np.random.default_rng(seed)
    pages = pool.allocate(len(tokens) // PS)
    slots = np.array([[p * PS + i for p in pages for i in range(PS)]])
    keys = [rng.standard_normal((1, HKV, slots.shape[1], D)).astype(np.float32) for _ in range(L)]
    pool.write_step(slots, keys, [k * 2 for k in keys])
    cache.insert(tokens, pages, [])
    data = [pool.storage.read_block(p) for p in pages]
    for p in reversed(pages):
        pool.decref(p)
    return data


def evict_all(pool, cache, seed=99):
    """Fill the pool with other content so every cached page is evicted."""
    compute(pool, cache, [200 + i for i in range(pool.num_pages * PS)], seed)


@pytest.mark.parametrize("sub", [0, 2], ids=["single", "two-level"])
def test_an_evicted_prefix_comes_back_from_the_store_bit_for_bit(sub):
    pool, cache, store = setup(sub=sub)
    tokens = list(range(8))
    data = compute(pool, cache, tokens, 1)
    evict_all(pool, cache)
    assert store.num_entries == 2 and cache.num_entries == pool.num_pages
    pages, _ = cache.match(tokens + [0])
    assert len(pages) == 2 and cache.last_match_tiers == {"host": 2}
    for page, want in zip(pages, data):
        got = pool.storage.read_block(page)
        assert all(np.array_equal(got[k], want[k]) for k in ("k", "v", "key_min", "key_max"))
        assert sub == 0 or np.array_equal(got["sub"], want["sub"])
        assert pool.is_cached(page) and pool.refcount(page) == 1
    pool.check_integrity([pages], check_data=True)
    cache.check_integrity()
    assert cache.match(tokens + [0])[0] == pages  # now in the pool again
    assert cache.last_match_tiers == {"pool": 2}


def test_a_store_hash_collision_is_rejected_by_the_token_check(monkeypatch):
    pool, cache, store = setup()
    compute(pool, cache, list(range(4)), 1)
    evict_all(pool, cache)
    from tinyserve_trt.runtime import prefix_cache as pc
    monkeypatch.setattr(pc, "compute_hash", lambda tokens, parent: next(iter(store._blocks)))
    pages, _ = cache.match([9, 9, 9, 9, 0])
    assert pages == [] and cache.last_match_tiers == {}
    pool.check_integrity([])


def test_a_failing_restore_is_undone_and_only_costs_the_reuse(monkeypatch):
    pool, cache, _ = setup()
    tokens = list(range(8))
    compute(pool, cache, tokens, 1)
    evict_all(pool, cache)
    before = (pool.num_free, pool.num_evictable, cache.num_entries)

    def broken(page, block):
        raise OSError("device lost")

    monkeypatch.setattr(pool.storage, "write_block", broken)
    assert cache.match(tokens + [0]) == ([], [])
    # the pages it evicted to make room stay evicted (stored), the rest is as before
    assert pool.num_free + pool.num_evictable == sum(before[:2]) and pool.in_use_pages() == []
    pool.check_integrity([])
    cache.check_integrity()


def test_a_store_that_raises_on_put_never_breaks_an_allocation(monkeypatch):
    pool, cache, store = setup()
    compute(pool, cache, list(range(8)), 1)

    def broken(*a):
        raise RuntimeError("store down")

    monkeypatch.setattr(store, "put", broken)
    pages = pool.allocate(4)  # evicts both cached pages through the callback
    assert len(pages) == 4 and cache.num_entries == 0
    pool.check_integrity([pages])
    cache.check_integrity()


def test_a_store_run_never_takes_more_pages_than_the_pool_has():
    pool, cache, _ = setup(num_pages=4)
    tokens = list(range(16))
    compute(pool, cache, tokens, 1)
    evict_all(pool, cache)
    held = pool.allocate(2)
    pages, _ = cache.match(tokens + [0])
    assert len(pages) == 2 and pool.num_available == 0
    pool.check_integrity([held, pages])


def test_write_through_and_flush_store_cached_pages():
    pool, cache, store = setup()
    compute(pool, cache, list(range(8)), 1)
    assert store.num_entries == 0
    assert cache.flush() == 2 and store.num_entries == 2 and cache.flush() == 0
    pool2 = PagePool(CacheConfig(page_size=PS, num_pages=4, dtype="float32"), L, HKV, D)
    wt = make_prefix_cache("hash", pool2, store=store, write_through=True)
    compute(pool2, wt, list(range(100, 108)), 2)
    assert store.num_entries == 4
    with pytest.raises(ValueError, match="prefix sharing"):
        make_prefix_cache("none", pool2, store=store)


@pytest.mark.parametrize("codec, sub", [(("int8", "channel", "token", 0), 0), (("int8", "head", "head", 0), 2),
                                        (("int4", "channel", "token", 4), 0), (("int4", "channel", "token", 4), 2)],
                         ids=["int8", "int8-two-level", "int4", "int4-two-level"])
def test_a_cold_page_leaves_as_its_promotion(codec, sub):
    """``read_block`` of a cold page = the hot page ``copy_page`` (a promotion) makes of it."""
    from tinyserve_trt.ops.cold_codec import ColdCodec
    from tinyserve_trt.runtime.host_storage import HostKVStorage
    from tinyserve_trt.runtime.kvstore.block import PageBlock

    d = 8
    st = HostKVStorage(L, 3, HKV, PS, d, "float32", num_cold=1, codec=ColdCodec(*codec), sub_page_size=sub)
    rng = np.random.default_rng(0)
    k = (rng.standard_normal((L, PS, HKV, d)) * 3).astype(np.float32)
    slots = np.arange(PS)
    st.write_layers(slots, k, k[::-1].copy(), np.array([0]), np.full((L, 1), PS))
    st.demote_page(0, 3)
    cold = st.read_block(3)
    st.copy_page(3, 1)
    promoted = st.read_block(1)
    for name in ("k", "v", "key_min", "key_max") + (("sub",) if sub else ()):
        np.testing.assert_array_equal(cold[name], promoted[name], err_msg=name)
    st.write_block(2, PageBlock(tokens=np.zeros(PS, np.int64), parent=None, num_valid=np.full(L, PS, np.int32),
                                **cold))
    assert all(np.array_equal(st.read_block(2)[n], promoted[n]) for n in ("k", "v", "key_min", "key_max"))
