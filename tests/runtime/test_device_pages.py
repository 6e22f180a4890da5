"""DevicePages: the TensorRT backend's page storage, on CPU torch tensors.

A pool whose storage is DevicePages (``PagePool.attach_storage``) must end up holding
exactly what the pool over the numpy ``HostKVStorage`` holds after the same writes,
demotions and copy-on-write copies: int8 values, scales, min/max, valid counts. On a GPU the
same code runs on CUDA tensors (the ``cuda`` cases, marked ``gpu``: ``benchmarks/gpu_check.sh``
runs them); only the token writes are the append kernel's.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tinyserve_dev.kernels.references import append_kv_ref  # noqa: E402
from tinyserve_trt.ops.cold_codec import ColdCodec, page_bounds  # noqa: E402
from tinyserve_trt.ops.quantization import GRANULARITIES  # noqa: E402
from tinyserve_trt.runtime.backends.device_pages import COLD_ROLES, HOT_ROLES, DevicePages  # noqa: E402
from tinyserve_trt.runtime.config import CacheConfig  # noqa: E402
from tinyserve_trt.runtime.kv_storage import KVStorage  # noqa: E402
from tinyserve_trt.runtime.pages import PagePool, PoolIntegrityError  # noqa: E402
from tinyserve_trt.runtime.tiers import TierConfig, TieredPagePool  # noqa: E402

PS, L, H, D = 4, 2, 2, 8
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch: the device-side demotion runs on CPU tensors only")
    return torch.device(request.param)


# (cold format, K granularity, V granularity, group size): the INT8 tier's shapes and INT4's channel groups.
CODECS = [("int8", g, g, 0) for g in GRANULARITIES] + [("int4", "channel", "token", 0), ("int4", "channel", "token", 4),
                                                       ("int4", "channel", "head", 2), ("int4", "channel", "channel", 4)]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_quantize_matches_the_numpy_codec(codec, dtype, device):
    codec = ColdCodec(*codec)
    rng = np.random.default_rng()
    x = (rng.standard_normal((5, H, PS, D)) * rng.uniform(0.1, 30, (5, H, 1, D))).astype(dtype)
    x[0, 1] = 0  # an all-zero group takes scale 1
    x[1, :, :, 3] *= 50  # an outlier channel
    x[2, :, :, 5] = 1e-9  # int4: float16 scales clamp at its smallest normal
    kmin, kmax = page_bounds(x)
    for which in ("k", "v"):
        want = [codec.quantize(page, which) for page in x]
        bounds = tuple(torch.from_numpy(b).to(device) for b in (kmin, kmax)) if which == "k" else None
        q, s = codec.quantize(torch.from_numpy(x).to(device), which, bounds=bounds)
        np.testing.assert_array_equal(q.cpu().numpy(), np.stack([w[0] for w in want]))
        np.testing.assert_array_equal(s.cpu().numpy(), np.stack([w[1] for w in want]))
        qn, sn = (np.stack(a) for a in zip(*want))
        if which == "k":  # INT4: on the page bounds (float32); INT8 by the scales
            got = codec.dequantize_keys(q, s, *bounds, torch.float32).cpu().numpy()
            np.testing.assert_array_equal(got, codec.dequantize_keys(qn, sn, kmin, kmax))
        else:
            np.testing.assert_array_equal(codec.dequantize(q, s, torch.float32).cpu().numpy(),
                                          codec.dequantize(qn, sn))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_int4_keys_on_sub_page_codes_match_the_numpy_codec(dtype, device):
    """Format 3, two-level: quantizing / dequantizing keys on their sub-page codes is the codec's."""
    from tinyserve_trt.ops.fine_bounds import pages_sub_bounds

    codec = ColdCodec("int4", "channel", "token", 4)
    rng = np.random.default_rng()
    x = (rng.standard_normal((5, H, PS, D)) * rng.uniform(0.1, 30, (5, H, 1, D))).astype(dtype)
    kmin, kmax = page_bounds(x)
    codes = pages_sub_bounds(x, 2, kmin, kmax, np.full(5, PS))
    assert codes.any()  # sub-page bounds tighter than the page's somewhere
    want = [codec.quantize(x[i], "k", bounds=(kmin[i], kmax[i]), sub_codes=codes[i]) for i in range(5)]
    qn, sn = (np.stack(a) for a in zip(*want))
    tb = [torch.from_numpy(b).to(device) for b in (kmin, kmax, codes)]
    q, s = codec.quantize(torch.from_numpy(x).to(device), "k", bounds=tuple(tb[:2]), sub_codes=tb[2])
    np.testing.assert_array_equal(q.cpu().numpy(), qn)
    got = codec.dequantize_keys(q, s, tb[0], tb[1], torch.float32, tb[2]).cpu().numpy()
    np.testing.assert_array_equal(got, codec.dequantize_keys(qn, sn, kmin, kmax, sub_codes=codes))


def _pools(device, dtype="float32", k_gran="channel", v_gran="token", static=False, cold_format="int8",
           group_size=0, sub_page_size=0, int8_layers=()):
    """(numpy pool, device-attached pool, its DevicePages) of the same geometry; ``static``:
    calibrated scales (small enough that some values clip); ``int8_layers``: an int4 tier's INT8 layers."""
    config = CacheConfig(page_size=PS, num_pages=6, dtype=dtype, sub_page_size=sub_page_size)
    tiers = TierConfig(num_cold_pages=4, k_granularity=k_gran, v_granularity=v_gran,
                       scales="static" if static else "dynamic", cold_format=cold_format, group_size=group_size,
                       int8_layers=int8_layers)
    scales = (np.full((L, H, 1, D), 6.0 / 127, np.float32), np.full((L, H, 1, 1), 9.0 / 127, np.float32)) \
        if static else None
    host, dev = (TieredPagePool(config, tiers, L, H, D, static_scales=scales) for _ in range(2))
    pages = DevicePages(dev, TORCH_DTYPES[dtype], device, dict(k_granularity=k_gran, v_granularity=v_gran,
                                                               cold_format=cold_format, group_size=group_size,
                                                               int8_layers=list(int8_layers)))
    dev.attach_storage(pages)
    return host, dev, pages


def _write(host, dev, pages, page_table, past, k, v, kernel=True):
    """One step's tokens ``k, v [B, H, S, D]`` at ``past`` into both pools: the device
    side as ``qsa_append_kv`` writes them (through the physical table), or with
    ``kernel=False`` through the pool's ``write_batch`` like the host side."""
    B, _, S, _ = k.shape
    slots = np.array([[page_table[b][(past[b] + i) // PS] * PS + (past[b] + i) % PS for i in range(S)]
                      for b in range(B)])
    for layer in range(L):
        host.write_batch(layer, slots, k, v)
        if not kernel:
            dev.write_batch(layer, slots, k, v)
            continue
        t = pages.layers[layer]
        got = append_kv_ref(k, v, *(t[r].cpu().numpy() for r in HOT_ROLES), dev.physical_table(page_table),
                            np.asarray(past))
        for role, array in zip(HOT_ROLES, got):
            t[role].copy_(torch.from_numpy(array).to(t[role].device))
    if kernel:
        dev.note_device_writes(slots)


def _assert_same(host, dev, pages, handles):
    pages.flush()
    for h in handles:
        p = host.physical(h)
        assert dev.physical(h) == p
        for layer in range(L):
            t = pages.layers[layer]
            np.testing.assert_array_equal(dev.num_valid(layer)[p], host.num_valid(layer)[p])
            np.testing.assert_array_equal(t["key_min"][p].cpu().numpy(), host.key_min(layer)[p])
            np.testing.assert_array_equal(t["key_max"][p].cpu().numpy(), host.key_max(layer)[p])
            if host.storage.sub_page_size:
                np.testing.assert_array_equal(t["key_sub_bounds"][p].cpu().numpy(),
                                              host.storage.read_sub_bounds(layer, p))
            if p < host.num_hot:
                n = host.num_valid(layer)[p]
                np.testing.assert_array_equal(t["key_cache"][p, :, :n].cpu().numpy(), host.k_pages(layer)[p, :, :n])
                np.testing.assert_array_equal(t["value_cache"][p, :, :n].cpu().numpy(), host.v_pages(layer)[p, :, :n])
            else:
                c = p - host.num_hot
                np.testing.assert_array_equal(t["key_cache_int8"][c].cpu().numpy(), host.k_pages_int8(layer)[c])
                np.testing.assert_array_equal(t["value_cache_int8"][c].cpu().numpy(), host.v_pages_int8(layer)[c])
                np.testing.assert_array_equal(t["key_scale"][c].cpu().numpy(), host.k_scale(layer)[c])
                np.testing.assert_array_equal(t["value_scale"][c].cpu().numpy(), host.v_scale(layer)[c])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("grans,static,cold", [(("channel", "token"), False, ("int8", 0)),
                                               (("head", "channel"), False, ("int8", 0)),
                                               (("channel", "token"), True, ("int8", 0)),
                                               (("channel", "token"), False, ("int4", 0)),
                                               (("channel", "head"), False, ("int4", 4)),
                                               (("channel", "token"), False, ("int4", 4, 2)),
                                               (("channel", "token"), False, ("int4", 4, 2, (0,))),
                                               (("channel", "token"), False, ("int4", 4, 2, (1,)))],
                         ids=["channel-token", "head-channel", "static", "int4-channel-token", "int4-channel-head-g4",
                              "int4-two-level", "int4-two-level-int8-layer-0", "int4-two-level-int8-layer-1"])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel-writes", "pool-writes"])
def test_device_pool_holds_what_the_numpy_pool_holds(dtype, grans, static, cold, kernel, device):
    rng = np.random.default_rng()
    host, dev, pages = _pools(device, dtype, *grans, static=static, cold_format=cold[0], group_size=cold[1],
                              sub_page_size=cold[2] if len(cold) > 2 else 0,
                              int8_layers=cold[3] if len(cold) > 3 else ())
    for layer in range(L):  # each layer's device pools in its own codec (int8_layers: INT8 values)
        want = np.int8 if cold[0] == "int8" or layer in (cold[3] if len(cold) > 3 else ()) else np.uint8
        assert pages.layers[layer]["key_cache_int8"].cpu().numpy().dtype == want
    a, b = host.allocate(3), dev.allocate(3)
    assert a == b
    k = (rng.standard_normal((1, H, 10, D)) * 4).astype(dtype)
    _write(host, dev, pages, [a], [0], k, -k, kernel)  # pages 0, 1 full; page 2 holds 2 tokens
    assert [host.demote(p) for p in a[:2]] == [dev.demote(p) for p in a[:2]]
    _assert_same(host, dev, pages, a)
    k2 = rng.standard_normal((1, H, 1, D)).astype(dtype)
    _write(host, dev, pages, [a], [10], k2, k2, kernel)  # a decode token after the demotions
    # copy-on-write of a cold page into a fresh hot one (a shared prefix diverging)
    host.incref(a[0]), dev.incref(a[0])
    (c_host,), (c_dev,) = host.allocate(1), dev.allocate(1)
    assert c_host == c_dev and host.physical(c_host) == dev.physical(c_dev)
    host.copy_page(a[0], c_host)
    dev.copy_page(a[0], c_dev)
    _assert_same(host, dev, pages, a + [c_host])
    dev.check_integrity([a, a[:1] + [c_dev]], check_data=True)  # min/max read back from the device
    host.check_integrity([a, a[:1] + [c_host]], check_data=True)
    with torch.no_grad():
        pages.layers[1]["key_max"][dev.physical(a[2])] += 1  # a stale max on the device is caught
    with pytest.raises(PoolIntegrityError, match="stale"):
        dev.check_integrity(check_data=True)


def test_a_cold_slot_demoted_into_twice_before_a_flush_keeps_the_later_page():
    pool = TieredPagePool(CacheConfig(page_size=PS, num_pages=4), TierConfig(num_cold_pages=1), L, H, D)
    pages = DevicePages(pool, torch.float32, torch.device("cpu"), dict(k_granularity="head", v_granularity="head"))
    for layer in pages.layers:
        layer["key_cache"][0], layer["key_cache"][1] = 1.0, 2.0
    pages.demote_page(0, 4)
    pages.demote_page(1, 4)  # page 0's cold copy was evicted before the flush
    pages.flush()
    got = ColdCodec("int8", "head", "head").dequantize(pages.layers[0]["key_cache_int8"][0].numpy(),
                                                       pages.layers[0]["key_scale"][0].numpy())
    np.testing.assert_array_equal(got, 2.0)
    assert pages.layers[1]["key_max"][4].max().item() == 2.0


def test_note_device_writes_counts_valid_tokens_and_checks_pages():
    pool = PagePool(CacheConfig(page_size=PS, num_pages=4), L, H, D)
    pool.attach_storage(DevicePages(pool, torch.float32, torch.device("cpu")))
    p, q = pool.allocate(2)
    pool.note_device_writes(np.array([[p * PS, p * PS + 1, p * PS + 2, -1], [q * PS, -1, -1, -1]]))
    assert pool.num_valid(0)[p] == 3 and pool.num_valid(L - 1)[q] == 1
    pool.note_device_writes(np.array([[p * PS + 3]]))
    assert pool.num_valid(1)[p] == PS
    pool.incref(q)
    with pytest.raises(ValueError, match="shared"):
        pool.note_device_writes(np.array([[q * PS + 1]]))
    with pytest.raises(ValueError, match="shared"):
        pool.write_tokens(0, np.array([q * PS + 1]), np.zeros((1, H, D), np.float32), np.zeros((1, H, D), np.float32))
    tiered = TieredPagePool(CacheConfig(page_size=PS, num_pages=2), TierConfig(num_cold_pages=2), L, H, D)
    tiered.attach_storage(DevicePages(tiered, torch.float32, torch.device("cpu"),
                                      dict(k_granularity="head", v_granularity="head")))
    (r,) = tiered.allocate(1)
    tiered.note_device_writes(np.arange(PS)[None] + r * PS)
    tiered.demote(r)
    with pytest.raises(ValueError, match="cold"):
        tiered.note_device_writes(np.array([[r * PS]]))


def test_layouts_and_errors():
    plain = PagePool(CacheConfig(page_size=PS, num_pages=5), L, H, D)
    pages = DevicePages(plain, torch.float16, torch.device("cpu"), dict(k_granularity="channel", v_granularity="token"))
    t = pages.layers[0]
    assert pages.roles == HOT_ROLES + COLD_ROLES and (pages.num_hot, pages.num_cold) == (5, 1)
    assert t["key_min"].shape == (6, H, D) and t["key_cache_int8"].shape == (1, H, PS, D)  # Ptot >= P + Pcold
    assert t["key_scale"].shape == (1, H, 1, D) and t["value_scale"].shape == (1, H, PS, 1)
    bare = DevicePages(plain, torch.float32, torch.device("cpu"))
    assert bare.roles == HOT_ROLES and bare.layers[0]["key_min"].shape == (5, H, D)
    with pytest.raises(ValueError, match="no cold tier"):
        bare.demote_page(0, 5)
    with pytest.raises(ValueError, match="outside"):
        pages.demote_page(0, 2)
    with pytest.raises(ValueError, match="outside"):
        pages.copy_page(0, 5)
    tiered = TieredPagePool(CacheConfig(page_size=PS, num_pages=2), TierConfig(num_cold_pages=2), L, H, D)
    with pytest.raises(ValueError, match="cold tier"):
        DevicePages(tiered, torch.float32, torch.device("cpu"))


def test_storage_is_attached_only_to_an_empty_pool_of_its_geometry():
    pool = PagePool(CacheConfig(page_size=PS, num_pages=4), L, H, D)
    pages = DevicePages(pool, torch.float32, torch.device("cpu"), dict(k_granularity="head", v_granularity="head"))
    assert isinstance(pages, KVStorage) and pages.roles == HOT_ROLES + COLD_ROLES
    other = PagePool(CacheConfig(page_size=PS, num_pages=5), L, H, D)
    with pytest.raises(ValueError, match="geometry"):
        other.attach_storage(pages)
    (p,) = pool.allocate(1)
    with pytest.raises(ValueError, match="empty pool"):
        pool.attach_storage(pages)
    pool.decref(p)
    pool.attach_storage(pages)  # the unused cold page of a plain pool is accepted
    assert pool.storage is pages and pool.cache_inputs(0) is pages.layers[0]


def test_int4_layouts():
    """INT4 pools have the host storage's shapes, dtypes and never-written contents."""
    tiers = TierConfig(num_cold_pages=3, k_granularity="channel", v_granularity="token", cold_format="int4",
                       group_size=4)
    pool = TieredPagePool(CacheConfig(page_size=PS, num_pages=2), tiers, L, H, D)
    cold_tier = dict(k_granularity="channel", v_granularity="token", cold_format="int4", group_size=4)
    pages = DevicePages(pool, torch.float16, torch.device("cpu"), cold_tier)
    host = pool.storage.cache_inputs(0)
    for role in COLD_ROLES:
        t = pages.layers[0][role]
        assert tuple(t.shape) == host[role].shape and str(t.dtype) == f"torch.{host[role].dtype}", role
        np.testing.assert_array_equal(t.numpy(), host[role])  # never-written pages: q = 0, scale 1, as the host
