"""TieredPagePool: handles over hot float + cold INT8 slots, demotion, integrity."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyserve_trt.ops import schema, sparse_attention_ref
from tinyserve_trt.runtime.config import CacheConfig, SchedulerConfig
from tinyserve_trt.runtime.pages import OutOfPagesError, PoolIntegrityError
from tinyserve_trt.runtime.scheduler import Scheduler
from tinyserve_trt.runtime.tiers import TierConfig, TieredPagePool

from tests.runtime.fakes import step

PS, L, H, D = 4, 2, 2, 8


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def make_pool(hot=6, cold=4, dtype="float32", sub_page_size=0, **tier):
    return TieredPagePool(CacheConfig(page_size=PS, num_pages=hot, dtype=dtype, sub_page_size=sub_page_size),
                          TierConfig(num_cold_pages=cold, **tier), L, H, D)


def fill(pool, page, rng, n=PS, start=0):
    for layer in range(L):
        k = rng.standard_normal((n, H, D)).astype(pool.k_pages(0).dtype)
        pool.write_tokens(layer, page * PS + np.arange(start, start + n), k, -k)


def test_config_validation():
    with pytest.raises(ValueError, match="num_cold_pages"):
        TierConfig(num_cold_pages=0)
    with pytest.raises(ValueError, match="k_granularity"):
        TierConfig(k_granularity="group")


def test_demote_rebinds_the_handle(rng):
    pool = make_pool()
    a, b = pool.allocate(2)
    fill(pool, a, rng)
    fill(pool, b, rng, n=2)
    keys = pool.dequantized_keys(0, a).copy()
    old, new = pool.demote(a)
    assert old < pool.num_hot <= new and pool.physical(a) == new and not pool.is_hot(a)
    assert pool.num_hot_free == 5 and pool.num_cold_free == 3
    deq = pool.dequantized_keys(0, a)
    assert np.all(np.abs(deq - keys) <= np.broadcast_to(pool.k_scale(0)[new - pool.num_hot], keys.shape) / 2 + 1e-6)
    pool.check_integrity([[a, b]], check_data=True)
    np.testing.assert_array_equal(pool.physical_table(np.array([[a, b]])), [[new, pool.physical(b)]])
    with pytest.raises(ValueError, match="cold"):
        pool.write_tokens(0, np.array([a * PS]), np.zeros((1, H, D), np.float32), np.zeros((1, H, D), np.float32))
    with pytest.raises(ValueError, match="not full"):
        pool.demote(b)
    with pytest.raises(ValueError, match="already cold"):
        pool.demote(a)
    pool.decref(a)  # frees the cold slot
    assert pool.num_cold_free == 4 and pool.physical(a) == -1
    pool.check_integrity([[b]], check_data=True)


def test_copy_on_write_from_a_cold_page(rng):
    pool = make_pool()
    (a,) = pool.allocate(1)
    fill(pool, a, rng)
    pool.demote(a)
    (c,) = pool.allocate(1)
    pool.copy_page(a, c)
    np.testing.assert_array_equal(pool.dequantized_keys(1, c), pool.dequantized_keys(1, a))
    pool.check_integrity([[a], [c]], check_data=True)


def test_allocation_needs_hot_slots_and_evicts_cached_ones(rng):
    pool = make_pool(hot=2, cold=2)
    a, b = pool.allocate(2)
    fill(pool, a, rng)
    pool.demote(a)  # a frees its hot slot: one more page can be allocated
    assert pool.num_available == 1
    (c,) = pool.allocate(1)
    assert pool.num_available == 0
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)
    evicted = []
    pool.set_evict_callback(evicted.append)
    pool.mark_cached(b)
    pool.decref(b)  # evictable, holds a hot slot
    assert pool.num_available == 1
    (d,) = pool.allocate(1)
    assert evicted == [b] and pool.is_hot(d)
    pool.check_integrity([[a], [c], [d]])


def test_demote_evicts_a_cached_cold_page_when_the_tier_is_full(rng):
    pool = make_pool(hot=3, cold=1)
    a, b = pool.allocate(2)
    fill(pool, a, rng), fill(pool, b, rng)
    pool.demote(a)
    pool.mark_cached(a)
    pool.decref(a)
    pool.demote(b)  # evicts a
    assert pool.physical(a) == -1 and not pool.is_cached(a)
    pool.check_integrity([[b]], check_data=True)
    (c,) = pool.allocate(1)
    fill(pool, c, rng)
    with pytest.raises(OutOfPagesError, match="cold tier full"):
        pool.demote(c)


def mixed_tier_feeds(pool, rng, dtype) -> dict:
    """Two sequences (14 and 9 tokens) filled, three of their pages demoted, integrity checked:
    the op's feeds over the pool's mixed-tier cache inputs (budget 8 and dense)."""
    lens = (14, 9)
    pages = [pool.allocate(-(-n // PS)) for n in lens]
    for seq, n in zip(pages, lens):
        for j, p in enumerate(seq):
            fill(pool, p, rng, n=min(PS, n - j * PS))
    for p in (pages[0][0], pages[0][2], pages[1][1]):
        pool.demote(p)
    pool.check_integrity(pages, check_data=True)
    table = np.array([seq + [seq[0]] * (4 - len(seq)) for seq in pages])
    feeds = dict(pool.cache_inputs(0), page_table=pool.physical_table(table),
                 past_lens=np.array(lens, np.int32), token_budget=np.array([8, 0], np.int32),
                 query=rng.standard_normal((2, 4, 1, D)).astype(dtype),
                 key=rng.standard_normal((2, H, 1, D)).astype(dtype),
                 value=rng.standard_normal((2, H, 1, D)).astype(dtype))
    return feeds


@pytest.mark.parametrize("dtype", schema.FLOAT_TYPES)
def test_the_op_reads_a_tiered_pool(rng, dtype):
    """Pool views + physical page table are the op's mixed-tier inputs; ORT agrees with the reference."""
    onnxruntime = pytest.importorskip("onnxruntime")
    from tinyserve_trt.ops.node import make_op_model

    pool = make_pool(hot=8, cold=6, dtype=dtype)
    feeds = mixed_tier_feeds(pool, rng, dtype)
    attrs = schema.OpAttributes()
    ref, ref_sel = sparse_attention_ref(**feeds, attrs=attrs)
    sess = onnxruntime.InferenceSession(make_op_model(dtype, attrs, cold_pages=True).SerializeToString(),
                                        providers=["CPUExecutionProvider"])
    out, sel = sess.run(None, {n: feeds[n] for n in schema.node_input_names(cold_pages=True)})
    np.testing.assert_allclose(out.astype(np.float64), ref.astype(np.float64), **schema.TOLERANCES[dtype])
    np.testing.assert_array_equal(sel.sum(-1), ref_sel.sum(-1))


# alloc/write/demote listed twice: pages must be allocated and filled before they can be demoted
OPS = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "write", "write", "demote", "demote", "promote",
                                          "decref", "incref", "cache", "uncache", "copy"]), st.integers(0, 1 << 16)),
               min_size=20, max_size=80)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS, st.sampled_from(["channel", "token", "head"]), st.sampled_from([("int8", 0), ("int4", 0), ("int4", 4)]),
       st.sampled_from([0, 1, 2]), st.sampled_from(["float32", "float16"]))
def test_random_operations_keep_integrity(ops, granularity, fmt, sub_page_size, dtype):
    """INT8 and INT4 cold tiers (INT4 keys per channel on the page bounds, float16 pools too:
    rounding the dequantized keys must not leave the bounds); two-level pools (sub_page_size > 0)
    too: check_data recomputes every live page's sub-page codes."""
    rng = np.random.default_rng(0)
    pool = make_pool(hot=5, cold=3, dtype=dtype, sub_page_size=sub_page_size,
                     k_granularity="channel" if fmt[0] == "int4" else granularity,
                     v_granularity=granularity, cold_format=fmt[0], group_size=fmt[1])
    holders: list[list[int]] = []  # each holder references one page
    for op, x in ops:
        live = [h[0] for h in holders]
        try:
            if op == "alloc":
                holders += [[p] for p in pool.allocate(1 + x % 2)]
            elif op == "write" and live:
                p = live[x % len(live)]
                if pool.is_writable(p) and pool.is_hot(p):
                    start = int(pool.num_valid(0)[pool.physical(p)])
                    if start < PS:
                        fill(pool, p, rng, n=PS - start if x % 2 else min(PS - start, 1 + x % PS), start=start)
            elif op == "demote" and live:
                full = [p for p in live if pool.is_hot(p) and pool.num_valid(0)[pool.physical(p)] == PS]
                pool.demote((full or live)[x % len(full or live)])
            elif op == "promote" and (pool.cold_pages() or live):
                cands = pool.cold_pages() or live  # a hot or free page: ValueError
                page = cands[x % len(cands)]
                keys = pool.dequantized_keys(1, page).copy() if pool.physical(page) >= 0 else None
                pool.promote(page)
                # promotion rounds INT4's float32 keys to the pool dtype (inside the page bounds)
                assert pool.is_hot(page) and np.array_equal(pool.dequantized_keys(1, page),
                                                            keys.astype(pool.k_pages(0).dtype))
            elif op == "decref" and holders:
                pool.decref(holders.pop(x % len(holders))[0])
            elif op == "incref":
                cands = live + list(pool._evictable)
                if cands:
                    p = cands[x % len(cands)]
                    pool.incref(p)
                    holders.append([p])
            elif op == "cache" and live:
                pool.mark_cached(live[x % len(live)])
            elif op == "uncache" and pool.cached_pages():
                pool.unmark_cached(pool.cached_pages()[x % len(pool.cached_pages())])
            elif op == "copy" and live:
                (dst,) = pool.allocate(1)
                pool.copy_page(live[x % len(live)], dst)
                holders.append([dst])
        except (OutOfPagesError, ValueError) as e:
            assert not isinstance(e, PoolIntegrityError)
        pool.check_integrity(holders, check_data=True)


def test_scheduler_runs_on_a_tiered_pool_with_demotions():
    """The scheduler and prefix cache keep working, untouched, while pages are demoted between steps."""
    rng = np.random.default_rng(7)
    pool = TieredPagePool(CacheConfig(page_size=4, num_pages=24, dtype="float16"), TierConfig(num_cold_pages=24),
                          1, 1, 4)
    sched = Scheduler(SchedulerConfig(max_batch=8, max_tokens_per_step=64, prefill_chunk=16), pool)
    from tinyserve_trt.runtime.sampling import SamplingParams
    shared = list(rng.integers(1, 50, 12))
    for i in range(40):
        sched.add(f"r{i}", shared + list(rng.integers(1, 50, int(rng.integers(1, 10)))),
                  SamplingParams(max_tokens=int(rng.integers(1, 16))))
    demoted = 0
    while sched.has_unfinished():
        step(sched, rng, vocab=64)
        for seq in sched.running:
            for p in seq.pages[:-2]:  # never the pages being written
                if pool.is_hot(p) and pool.num_cold_free and rng.random() < 0.5:
                    pool.demote(p)
                    demoted += 1
        sched.check_integrity()
        pool.check_integrity([s.pages for s in sched.running], check_data=True)
    assert demoted > 10


def test_plain_pool_reads_the_same_way():
    from tinyserve_trt.runtime.pages import PagePool

    pool = PagePool(CacheConfig(page_size=PS, num_pages=4, dtype="float32"), L, H, D)
    table = np.array([[3, 1]], np.int64)
    assert pool.physical_table(table).dtype == np.int32 and pool.physical_table(table).tolist() == [[3, 1]]
    inputs = pool.cache_inputs(1)
    assert set(inputs) == set(schema.INPUT_NAMES[3:7])
    assert np.shares_memory(inputs["key_cache"], pool.k_pages(1))
    tiered = make_pool()
    assert set(tiered.cache_inputs(0)) == set(schema.INPUT_NAMES[3:7]) | set(schema.COLD_INPUTS)


def test_static_scales_are_the_calibrated_ones(rng):
    k_static = rng.uniform(0.5, 2.0, (L, H, 1, D)).astype(np.float32) / 127
    v_static = rng.uniform(0.5, 2.0, (L, H, 1, 1)).astype(np.float32) / 127
    pool = TieredPagePool(
        CacheConfig(page_size=PS, num_pages=6), TierConfig(num_cold_pages=4, scales="static"), L, H, D,
        static_scales=(k_static, v_static))
    (a,) = pool.allocate(1)
    fill(pool, a, rng)
    keys = pool.k_pages(1)[pool.physical(a)].copy()
    _, new = pool.demote(a)
    c = new - pool.num_hot
    np.testing.assert_array_equal(pool.k_scale(1)[c], k_static[1])  # K per channel: the calibrated scale
    np.testing.assert_array_equal(pool.v_scale(1)[c], np.broadcast_to(v_static[1], (H, PS, 1)))  # V per token
    inside = np.abs(keys) <= 127 * np.broadcast_to(k_static[1], keys.shape)
    err = np.abs(pool.dequantized_keys(1, a) - keys)
    assert np.all(err[inside] <= np.broadcast_to(k_static[1], keys.shape)[inside] / 2 + 1e-6)
    assert np.any(~inside)  # standard normals past 2/127*127: some clip, and that is the point of the test
    pool.check_integrity([[a]], check_data=True)  # min/max are those of the clipped, dequantized keys
    with pytest.raises(ValueError, match="static"):
        TieredPagePool(CacheConfig(page_size=PS, num_pages=6), TierConfig(num_cold_pages=4, scales="static"), L, H, D)
    with pytest.raises(ValueError, match="static"):
        TieredPagePool(CacheConfig(page_size=PS, num_pages=6), TierConfig(num_cold_pages=4), L, H, D,
                       static_scales=(k_static, v_static))
    with pytest.raises(ValueError, match="positive"):
        TieredPagePool(CacheConfig(page_size=PS, num_pages=6), TierConfig(num_cold_pages=4, scales="static"), L, H,
                       D, static_scales=(k_static[:1], v_static))
    with pytest.raises(ValueError, match="scales"):
        TierConfig(scales="fixed")


def test_host_storage_addresses_physical_tiers_and_checks_them():
    from tinyserve_trt.runtime.host_storage import HostKVStorage
    from tinyserve_trt.runtime.kv_storage import COLD_ROLES, HOT_ROLES

    with pytest.raises(ValueError, match="cold tier"):
        HostKVStorage(1, 2, 1, 4, 2, "float32", num_cold=1)
    store = HostKVStorage(1, 2, 1, 4, 2, "float32", num_cold=1, granularities=("head", "head"))
    assert store.roles == HOT_ROLES + COLD_ROLES and store.cache_inputs(0)["key_min"].shape == (3, 1, 2)
    k = np.arange(8, dtype=np.float32).reshape(4, 1, 2)
    store.write_tokens(0, np.arange(4), k, -k, np.array([0]), np.array([4]))
    store.demote_page(0, 2)
    keys, kmin, kmax = store.read_page(0, 2)
    np.testing.assert_array_equal(kmin, keys.min(axis=1))
    np.testing.assert_array_equal(kmax, keys.max(axis=1))
    with pytest.raises(ValueError, match="outside"):
        store.write_tokens(0, np.array([8]), k[:1], k[:1], np.array([2]), np.array([1]))  # a cold slot
    with pytest.raises(ValueError, match="outside"):
        store.copy_page(0, 2)  # copies land in hot pages only


@pytest.mark.parametrize("fmt", [("int8", 0), ("int4", 4)])
def test_promotion_round_trip(rng, fmt):
    """demote -> promote: the handle stays, the keys are the dequantized ones, both slot lists balance."""
    pool = make_pool(hot=3, cold=2, cold_format=fmt[0], group_size=fmt[1])
    a, b = pool.allocate(2)
    fill(pool, a, rng), fill(pool, b, rng)
    original = pool.dequantized_keys(0, a).copy()
    pool.demote(a)
    cold = pool.dequantized_keys(0, a).copy()
    assert 0 < np.abs(cold - original).max() <= np.abs(original).max() / (7 if fmt[0] == "int4" else 127)
    old, new = pool.promote(a)
    assert old >= pool.num_hot > new and pool.is_hot(a) and pool.num_cold_free == 2
    np.testing.assert_array_equal(pool.dequantized_keys(0, a), cold)  # exact reads of what was stored
    pool.check_integrity([[a], [b]], check_data=True)
    pool.demote(a)  # and back again
    pool.check_integrity([[a], [b]], check_data=True)
    with pytest.raises(ValueError, match="already hot"):
        pool.promote(b)
    (c,) = pool.allocate(1)
    (d,) = pool.allocate(1)  # takes the last hot slot
    with pytest.raises(OutOfPagesError, match="no free hot slot"):
        pool.promote(a)
    pool.decref(a)
    with pytest.raises(ValueError, match="free"):
        pool.promote(a)
    pool.check_integrity([[b], [c], [d]], check_data=True)


def test_int4_pool_is_what_the_op_reads(rng):
    """A tiered INT4 pool's cache inputs run the _int4 overload in ORT equal to the reference."""
    onnxruntime = pytest.importorskip("onnxruntime")
    from tinyserve_trt.ops.node import make_op_model

    pool = make_pool(hot=8, cold=6, cold_format="int4", group_size=4)
    assert pool.k_pages_int8(0).dtype == np.uint8 and pool.k_pages_int8(0).shape[-1] == D // 2
    feeds = mixed_tier_feeds(pool, rng, np.float32)
    ref, _ = sparse_attention_ref(**feeds, attrs=schema.OpAttributes())
    model = make_op_model("float32", schema.OpAttributes(), cold_pages=True, cold_format="int4")
    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out, _ = sess.run(None, {n: feeds[n] for n in schema.node_input_names(cold_pages=True)})
    np.testing.assert_allclose(out, ref, **schema.TOLERANCES["float32"])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_int4_two_level_demotion_keeps_metadata(rng, dtype):
    """Format 3: a two-level pool's INT4 demotion quantizes each key on its sub-page's codes, so the
    page's min/max and codes stay bit-for-bit, hold the dequantized keys, and a promotion recomputes
    exact hot metadata; the pool's inputs run the two-level _int4 overload equal to the reference."""
    onnxruntime = pytest.importorskip("onnxruntime")
    from tinyserve_trt.ops.node import make_op_model

    pool = make_pool(hot=8, cold=6, dtype=dtype, sub_page_size=2, cold_format="int4", group_size=4)
    (a,) = pool.allocate(1)
    fill(pool, a, rng)
    hot = pool.physical(a)
    before = [(pool.storage.read_page(layer, hot)[1:], pool.storage.read_sub_bounds(layer, hot).copy())
              for layer in range(L)]
    pool.demote(a)
    cold = pool.physical(a)
    for layer, ((kmin, kmax), codes) in enumerate(before):
        keys, cmin, cmax = pool.storage.read_page(layer, cold)
        np.testing.assert_array_equal(cmin, kmin)
        np.testing.assert_array_equal(cmax, kmax)
        np.testing.assert_array_equal(pool.storage.read_sub_bounds(layer, cold), codes)
        codec = pool.storage.codec
        np.testing.assert_array_equal(keys, codec.dequantize_keys(
            pool.storage.cache_inputs(layer)["key_cache_int8"][cold - pool.num_hot], np.ones((H, 1, 1)),
            kmin, kmax, sub_codes=codes))
    pool.check_integrity([[a]], check_data=True)
    pool.promote(a)
    pool.check_integrity([[a]], check_data=True)  # exact hot min/max and codes of the promoted keys
    pool.decref(a)

    feeds = mixed_tier_feeds(pool, rng, dtype)
    attrs = schema.OpAttributes(sub_page_size=2)
    ref, ref_sel = sparse_attention_ref(**feeds, attrs=attrs)
    model = make_op_model(dtype, attrs, cold_pages=True, cold_format="int4")
    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out, sel = sess.run(None, {n: feeds[n] for n in schema.node_input_names(True, True) if n})
    np.testing.assert_allclose(out.astype(np.float64), ref.astype(np.float64), **schema.TOLERANCES[dtype])
    np.testing.assert_array_equal(sel.sum(-1), ref_sel.sum(-1))


def test_int4_single_level_layers_of_a_two_level_pool_read_the_page_bounds(rng):
    """A two-level package's dense layers' nodes take no key_sub_bounds and read INT4 cold keys on
    the page bounds: the pool quantizes those layers so (and gives them codes of the dequantized
    keys), the two-level layers on their codes; each layer's op overload agrees with the reference."""
    onnxruntime = pytest.importorskip("onnxruntime")
    from tinyserve_trt.ops.cold_codec import ColdCodec
    from tinyserve_trt.ops.node import make_op_model

    pool = TieredPagePool(CacheConfig(page_size=PS, num_pages=8, dtype="float32", sub_page_size=2),
                          TierConfig(num_cold_pages=6, cold_format="int4", group_size=4), L, H, D,
                          two_level_layers=[1])
    assert [pool.storage.keys_on_codes(layer) for layer in range(L)] == [False, True]
    feeds = mixed_tier_feeds(pool, rng, "float32")  # demotes three pages, checks integrity
    codec, P = ColdCodec("int4", "channel", "token", 4), pool.num_hot
    for layer, two_level in ((0, False), (1, True)):
        x = pool.storage.cache_inputs(layer)
        codes = x["key_sub_bounds"][P:] if two_level else None
        want = codec.dequantize_keys(x["key_cache_int8"], x["key_scale"], x["key_min"][P:], x["key_max"][P:],
                                     sub_codes=codes)
        cold = [p for p in range(P, P + pool.num_cold) if x["key_max"][p].any()]
        assert cold
        for p in cold:
            np.testing.assert_array_equal(pool.storage.read_page(layer, p)[0], want[p - P])
        layer_feeds = dict(feeds, **x)
        attrs = schema.OpAttributes(sub_page_size=2 if two_level else 0)
        ref, _ = sparse_attention_ref(**layer_feeds, attrs=attrs)
        model = make_op_model("float32", attrs, cold_pages=True, cold_format="int4")
        sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        out, _ = sess.run(None, {n: layer_feeds[n] for n in schema.node_input_names(True, two_level) if n})
        np.testing.assert_allclose(out, ref, **schema.TOLERANCES["float32"])


def test_int8_layers_round_trip_each_layer_in_its_own_codec(rng):
    """An INT4 pool with int8_layers=[0]: layer 0's cold pools are INT8 (int8 values, float32 scales,
    keys on a scale), layer 1's packed INT4; demotion quantizes and promotion dequantizes each layer with
    its own codec (INT8's error bound is ~16x tighter than INT4's: the layers are told apart by it)."""
    from tinyserve_trt.contracts.cold_tier import cold_page_bytes

    pool = make_pool(hot=6, cold=4, cold_format="int4", group_size=4, int8_layers=[0])
    x0, x1 = pool.storage.cache_inputs(0), pool.storage.cache_inputs(1)
    assert x0["key_cache_int8"].dtype == np.int8 and x0["key_cache_int8"].shape[-1] == D
    assert x1["key_cache_int8"].dtype == np.uint8 and x1["key_cache_int8"].shape[-1] == D // 2
    (a,) = pool.allocate(1)
    fill(pool, a, rng)
    hot = pool.physical(a)
    k = [pool.storage.read_page(layer, hot)[0].copy() for layer in range(L)]
    v = [pool.storage.cache_inputs(layer)["value_cache"][hot].copy() for layer in range(L)]
    pool.demote(a)
    pool.check_integrity([[a]], check_data=True)
    cold = pool.physical(a)
    err = [np.abs(pool.storage.read_page(layer, cold)[0] - k[layer]).max() for layer in range(L)]
    span = [np.abs(k[layer]).max() for layer in range(L)]
    assert err[0] <= span[0] / 127 * 0.51 + 1e-6  # INT8: half a step of absmax / 127
    assert err[1] > span[1] / 127  # INT4: 15 levels, far coarser
    pool.promote(a)
    pool.check_integrity([[a]], check_data=True)
    new = pool.physical(a)
    for layer in range(L):
        vq = pool.storage.cache_inputs(layer)["value_cache"][new]
        assert np.abs(vq - v[layer]).max() <= (1.01 / 127 if layer == 0 else 1.01 / 15 * 2) * np.abs(v[layer]).max() \
            + 1e-6
    uniform = TierConfig(num_cold_pages=4, cold_format="int4", group_size=4)
    assert cold_page_bytes(pool.tiers, PS, L, H, D, "float32") > cold_page_bytes(uniform, PS, L, H, D, "float32")
    with pytest.raises(ValueError, match="layers' cold formats differ"):
        pool.storage.codec


def test_check_integrity_catches_a_layer_in_the_wrong_format():
    pool = make_pool(hot=6, cold=4, cold_format="int4", group_size=4, int8_layers=[0])
    pool.check_integrity()
    good = pool.storage._kq[0]
    pool.storage._kq[0] = np.zeros((4, H, PS, D // 2), np.uint8)  # INT4-shaped values in the INT8 layer
    with pytest.raises(PoolIntegrityError, match="layer 0's key_cache_int8 is uint8"):
        pool.check_integrity()
    pool.storage._kq[0] = good
    pool.storage.codecs[1] = pool.tiers.layer_codec(0)  # the storage thinks layer 1 is INT8 too
    with pytest.raises(PoolIntegrityError, match="layer 1 stores int8 cold pages, its tier says int4"):
        pool.check_integrity()


def test_tier_config_int8_layers_validation():
    with pytest.raises(ValueError, match="int8_layers applies to int4 cold pages only"):
        TierConfig(int8_layers=[0])
    with pytest.raises(ValueError, match="duplicates"):
        TierConfig(cold_format="int4", int8_layers=[1, 1])
    with pytest.raises(ValueError, match=r"int8_layers \[5\] out of range for a 2-layer model"):
        TierConfig(cold_format="int4", int8_layers=[5]).layer_codecs(2)
    assert TierConfig(cold_format="int4", int8_layers=[3, 1]).int8_layers == (1, 3)
    assert TierConfig(cold_format="int4", int8_layers=[0, 1]).describe() == "int4 (int8 layers 0,1)"
