import pytest

from tinyserve_trt.runtime import prefix_cache as pc
from tinyserve_trt.runtime.config import CacheConfig
from tinyserve_trt.runtime.pages import PagePool
from tinyserve_trt.runtime.prefix_cache import (HashPrefixCache, NoPrefixCache, PREFIX_CACHES,
                                                make_prefix_cache)


def setup(num_pages=8, page_size=4, name="hash"):
    pool = PagePool(CacheConfig(page_size=page_size, num_pages=num_pages, dtype="float32"), 1, 1, 2)
    return pool, make_prefix_cache(name, pool)


def hold(pool, cache, tokens):
    """A sequence that computed ``tokens``: its pages, registered."""
    pages = pool.allocate(-(-len(tokens) // pool.page_size))
    hashes = cache.insert(tokens, pages, [])
    return pages, hashes


def test_registry():
    assert set(PREFIX_CACHES) >= {"hash", "none"}
    with pytest.raises(ValueError, match="unknown prefix cache"):
        setup(name="radix")


def test_match_full_pages_only_and_increfs():
    pool, cache = setup()
    tokens = list(range(10))  # 2 full pages + 2 tokens
    pages, hashes = hold(pool, cache, tokens)
    assert cache.num_entries == 2 and len(hashes) == 2
    got, got_hashes = cache.match(tokens[:9])
    assert got == pages[:2] and got_hashes == hashes
    assert pool.refcount(pages[0]) == 2
    assert cache.match(tokens[:7])[0] == pages[:1]
    assert cache.match([99] + tokens[1:])[0] == []  # first page differs: nothing
    pool.check_integrity([pages, got, pages[:1]])
    cache.check_integrity()


def test_chain_depends_on_parent():
    pool, cache = setup()
    hold(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    # same second page after a different first page must not match the second page
    assert cache.match([9, 9, 9, 9, 5, 6, 7, 8])[0] == []


def test_hash_collision_is_rejected_by_token_check(monkeypatch):
    monkeypatch.setattr(pc, "compute_hash", lambda tokens, parent: b"same")
    pool, cache = setup()
    hold(pool, cache, [1, 2, 3, 4])
    assert cache.match([5, 6, 7, 8])[0] == []
    pages, _ = hold(pool, cache, [5, 6, 7, 8])  # colliding content stays private
    assert not pool.is_cached(pages[0]) and cache.num_entries == 1
    cache.check_integrity()


def test_unreferenced_pages_kept_then_evicted_lru():
    pool, cache = setup(num_pages=4)
    a, _ = hold(pool, cache, [1, 1, 1, 1])
    b, _ = hold(pool, cache, [2, 2, 2, 2])
    for p in b + a:  # release b first: b is least recently used
        pool.decref(p)
    assert pool.num_evictable == 2 and pool.num_free == 2
    assert cache.match([1, 1, 1, 1, 0])[0] == a  # still there, and now held again
    new = pool.allocate(3)  # 2 free + evicts b
    assert b[0] in new and cache.num_entries == 1
    assert cache.match([2, 2, 2, 2, 0])[0] == []
    pool.check_integrity([a, new])
    cache.check_integrity()


def test_discard_frees_entry():
    pool, cache = setup()
    pages, _ = hold(pool, cache, [1, 2, 3, 4])
    cache.discard(pages[0])
    assert pool.is_writable(pages[0]) and cache.num_entries == 0
    cache.check_integrity()


def test_none_cache_shares_nothing():
    pool, cache = setup(name="none")
    assert isinstance(cache, NoPrefixCache)
    pages, hashes = hold(pool, cache, list(range(8)))
    assert hashes == [] and cache.match(list(range(9))) == ([], [])
    pool.decref(pages[0])
    assert pool.num_evictable == 0
    assert isinstance(make_prefix_cache("hash", pool), HashPrefixCache)
