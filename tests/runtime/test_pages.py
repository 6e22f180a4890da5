import numpy as np
import pytest

from tinyserve_trt.runtime.config import CacheConfig
from tinyserve_trt.runtime.pages import OutOfPagesError, PagePool, PoolIntegrityError


def make_pool(num_pages=8, page_size=4, dtype="float32", layers=2, heads=2, dim=3):
    return PagePool(CacheConfig(page_size=page_size, num_pages=num_pages, dtype=dtype), layers, heads, dim)


def brute_minmax(pool, layer, page):
    n = pool.num_valid(layer)[page]
    keys = pool.k_pages(layer)[page, :, :n, :]
    if n == 0:
        return np.zeros_like(pool.key_min(layer)[page]), np.zeros_like(pool.key_max(layer)[page])
    return keys.min(axis=1), keys.max(axis=1)


def test_allocate_release_states():
    pool = make_pool()
    pages = pool.allocate(3)
    assert len(set(pages)) == 3 and pool.num_free == 5
    pool.check_integrity([pages])
    pool.incref(pages[0])
    pool.check_integrity([pages, [pages[0]]])
    pool.mark_cached(pages[1])
    for p in pages:
        pool.decref(p)
    pool.decref(pages[0])
    assert pool.num_free == 7 and pool.num_evictable == 1
    pool.check_integrity([])
    with pytest.raises(ValueError, match="no holder"):
        pool.decref(pages[0])
    with pytest.raises(ValueError, match="is free"):
        pool.incref(pages[0])


def test_allocate_evicts_lru_and_calls_back():
    pool = make_pool(num_pages=3)
    evicted = []
    pool.set_evict_callback(evicted.append)
    pages = pool.allocate(3)
    for p in pages:
        pool.mark_cached(p)
    for p in (pages[2], pages[0], pages[1]):  # release order = LRU order
        pool.decref(p)
    assert pool.num_available == 3
    pool.incref(pages[0])  # reuse leaves the LRU
    got = pool.allocate(2)
    assert got == [pages[2], pages[1]] and evicted == [pages[2], pages[1]]
    assert not pool.is_cached(pages[2])
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)
    pool.check_integrity([got, [pages[0]]])


def test_integrity_detects_wrong_refcount():
    pool = make_pool()
    pages = pool.allocate(2)
    with pytest.raises(PoolIntegrityError, match="refcount"):
        pool.check_integrity([pages[:1]])
    pool._free.append(pages[0])  # corrupt: free and in use
    with pytest.raises(PoolIntegrityError, match="both"):
        pool.check_integrity()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_minmax_matches_brute_force_after_random_writes(dtype):
    rng = np.random.default_rng(0)
    pool = make_pool(num_pages=6, page_size=4, dtype=dtype)
    pages = pool.allocate(6)
    for _ in range(200):
        layer = int(rng.integers(2))
        chosen = rng.choice(pages, size=int(rng.integers(1, 4)), replace=False)
        slots = []
        for p in chosen:
            valid = int(pool.num_valid(layer)[p])
            start = int(rng.integers(0, valid + 1))  # overwrite or append, never a gap
            count = int(rng.integers(1, pool.page_size - start + 1)) if start < pool.page_size else 0
            slots += [p * pool.page_size + start + i for i in range(count)]
        if not slots:
            continue
        k = rng.standard_normal((len(slots), 2, 3)).astype(dtype)
        pool.write_tokens(layer, np.array(slots), k, -k)
        if rng.random() < 0.05:  # reallocation resets the metadata
            p = int(rng.choice(pages))
            pool.decref(p)
            assert pool.allocate(1) == [p]
            assert pool.num_valid(0)[p] == 0 and not pool.key_max(1)[p].any()
        for layer_ in range(2):
            for p in pages:
                lo, hi = brute_minmax(pool, layer_, p)
                np.testing.assert_array_equal(pool.key_min(layer_)[p], lo)
                np.testing.assert_array_equal(pool.key_max(layer_)[p], hi)


def test_partial_page_minmax_covers_written_tokens_only():
    pool = make_pool(page_size=4, layers=1, heads=1, dim=1)
    (p,) = pool.allocate(1)
    pool.k_pages(0)[p] = -100.0  # stale data beyond the valid tokens must not count
    pool.write_tokens(0, np.array([p * 4, p * 4 + 1]), np.array([[[1.0]], [[3.0]]], np.float32),
                      np.zeros((2, 1, 1), np.float32))
    assert pool.key_min(0)[p, 0, 0] == 1.0 and pool.key_max(0)[p, 0, 0] == 3.0


def test_one_token_a_page_writes_append_overwrite_and_reject_gaps():
    """A decode step's write (one token in each of several pages, every layer at once): an append
    at a page's valid count grows it, an overwrite below it keeps it, one past it is a gap that
    raises before anything is written."""
    pool = make_pool(page_size=4, layers=2, heads=1, dim=1)
    a, b, c = pool.allocate(3)
    kv = lambda n: np.zeros((2, 2, 1, n, 1), np.float32)  # [layers, batch, heads, new, dim]
    pool.write_step(np.array([[a * 4], [b * 4]]), kv(1), kv(1))
    pool.write_step(np.array([[b * 4 + 1], [a * 4 + 1]]), kv(1), kv(1))
    assert [int(pool.num_valid(0)[p]) for p in (a, b, c)] == [2, 2, 0]
    pool.write_step(np.array([[a * 4], [b * 4 + 2]]), kv(1), kv(1))  # a: overwrite, b: append
    assert [int(pool.num_valid(1)[p]) for p in (a, b)] == [2, 3]
    with pytest.raises(ValueError, match="gap"):
        pool.write_step(np.array([[a * 4 + 2], [c * 4 + 1]]), kv(1), kv(1))
    assert [int(pool.num_valid(1)[p]) for p in (a, b, c)] == [2, 3, 0]


def test_write_rejects_gaps_duplicates_and_shared_pages():
    pool = make_pool(page_size=4, layers=1, heads=1, dim=1)
    a, b = pool.allocate(2)
    kv = np.zeros((1, 1, 1), np.float32)
    with pytest.raises(ValueError, match="gap"):
        pool.write_tokens(0, np.array([a * 4 + 2]), kv, kv)
    with pytest.raises(ValueError, match="duplicate"):
        pool.write_tokens(0, np.array([a * 4, a * 4]), np.zeros((2, 1, 1), np.float32),
                          np.zeros((2, 1, 1), np.float32))
    pool.incref(b)
    with pytest.raises(ValueError, match="copy-on-write"):
        pool.write_tokens(0, np.array([b * 4]), kv, kv)
    with pytest.raises(ValueError, match="must be"):
        pool.write_tokens(0, np.array([a * 4]), np.zeros((1, 2, 1), np.float32), kv)


def test_copy_page_really_copies():
    pool = make_pool(page_size=4)
    src, dst = pool.allocate(2)
    rng = np.random.default_rng(1)
    for layer in range(2):
        k = rng.standard_normal((3, 2, 3)).astype(np.float32)
        pool.write_tokens(layer, src * 4 + np.arange(3), k, k + 1)
    pool.copy_page(src, dst)
    for layer in range(2):
        np.testing.assert_array_equal(pool.k_pages(layer)[dst], pool.k_pages(layer)[src])
        np.testing.assert_array_equal(pool.v_pages(layer)[dst], pool.v_pages(layer)[src])
        np.testing.assert_array_equal(pool.key_min(layer)[dst], pool.key_min(layer)[src])
        assert pool.num_valid(layer)[dst] == 3
    before = pool.k_pages(0)[src].copy()
    pool.write_tokens(0, np.array([dst * 4 + 3]), np.ones((1, 2, 3), np.float32),
                      np.ones((1, 2, 3), np.float32))
    np.testing.assert_array_equal(pool.k_pages(0)[src], before)  # not a view
    assert pool.num_valid(0)[src] == 3 and pool.num_valid(0)[dst] == 4


def test_write_batch_skips_padding():
    pool = make_pool(page_size=4, layers=1, heads=2, dim=3)
    a, b = pool.allocate(2)
    slot_mapping = np.array([[a * 4, a * 4 + 1], [b * 4, -1]])
    k = np.arange(2 * 2 * 2 * 3, dtype=np.float32).reshape(2, 2, 2, 3)  # [B, Hkv, T, D]
    pool.write_batch(0, slot_mapping, k, k)
    np.testing.assert_array_equal(pool.k_pages(0)[a][:, :2], k[0])
    np.testing.assert_array_equal(pool.k_pages(0)[b][:, 0], k[1, :, 0])
    assert pool.num_valid(0)[b] == 1
