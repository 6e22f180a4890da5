"""DevicePages under the page store (issue #33), on the CPU stand-ins: a page exported from the
device storage is what the numpy storage exports after the same writes (hot, and cold pages
dequantized), an import puts it back bit for bit, and the prefix cache's store round trip works
over a device-attached pool. The ``cuda`` cases (marked ``gpu``) run the pinned, side-stream path."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.runtime.test_device_pages import _pools, _write  # noqa: E402
from tinyserve_trt.runtime.backends.device_pages import DevicePages  # noqa: E402
from tinyserve_trt.runtime.config import CacheConfig  # noqa: E402
from tinyserve_trt.runtime.kvstore import PageBlock, StoreIdentity, make_page_store  # noqa: E402
from tinyserve_trt.runtime.kvstore.pool_io import page_block, restore_page  # noqa: E402
from tinyserve_trt.runtime.pages import PagePool  # noqa: E402
from tinyserve_trt.runtime.prefix_cache import make_prefix_cache  # noqa: E402

PS, L, H, D = 4, 2, 2, 8
NAMES = ("k", "v", "key_min", "key_max", "sub")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch: the store copies run on CPU tensors only")
    return torch.device(request.param)


def assert_blocks_equal(got: dict, want: dict):
    for name in NAMES:
        if want[name] is None:
            assert got[name] is None
        else:
            assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("cold", [("int8", 0, 0), ("int4", 0, 0), ("int4", 4, 2)],
                         ids=["int8", "int4", "int4-two-level"])
def test_an_exported_page_is_the_numpy_storages_hot_or_cold(dtype, cold, device):
    rng = np.random.default_rng()
    host, dev, pages = _pools(device, dtype, "channel", "token", cold_format=cold[0], group_size=cold[1],
                              sub_page_size=cold[2])
    a, b = host.allocate(3), dev.allocate(3)
    assert a == b
    k = (rng.standard_normal((1, H, 3 * PS, D)) * 4).astype(dtype)
    _write(host, dev, pages, [a], [0], k, -k)
    assert [host.demote(p) for p in a[:1]] == [dev.demote(p) for p in a[:1]]  # one cold page, two hot
    for p in a:
        phys = host.physical(p)
        assert dev.physical(p) == phys
        assert_blocks_equal(pages.read_block(phys), host.storage.read_block(phys))


@pytest.mark.parametrize("sub", [0, 2], ids=["single", "two-level"])
def test_an_imported_page_holds_the_block_and_a_bad_block_changes_nothing(sub, device):
    config = CacheConfig(page_size=PS, num_pages=4, dtype="float32", sub_page_size=sub)
    pool = PagePool(config, L, H, D)
    pages = DevicePages(pool, torch.float32, device)
    pool.attach_storage(pages)
    rng = np.random.default_rng()
    block = {"k": rng.standard_normal((L, H, PS, D)).astype(np.float32),
             "v": rng.standard_normal((L, H, PS, D)).astype(np.float32),
             "key_min": rng.standard_normal((L, H, D)).astype(np.float32),
             "key_max": rng.standard_normal((L, H, D)).astype(np.float32),
             "sub": rng.integers(0, 256, (L, H, PS // sub, D)).astype(np.uint8) if sub else None}
    full = PageBlock(tokens=np.arange(PS), parent=None, num_valid=np.full(L, PS, np.int32), **block)
    (page,) = pool.allocate(1, fill=lambda new: restore_page(pool, new[0], full))
    phys = int(pool._physical_ids(np.array([page]))[0])
    assert_blocks_equal(pages.read_block(phys), block)
    assert np.all(pool.num_valid(0)[phys] == PS)
    before = pages.read_block(phys)
    bad = PageBlock(tokens=np.arange(PS), parent=None, num_valid=np.full(L, PS, np.int32),
                    **{**block, "v": block["v"][:, :1]})
    with pytest.raises(ValueError, match="block v is"):
        pages.write_block(phys, bad)
    assert_blocks_equal(pages.read_block(phys), before)  # checked before anything was copied
    with pytest.raises(ValueError, match="outside"):
        pages.write_block(pool.num_pages, full)
    with pytest.raises(ValueError, match="sub-page bounds"):
        pages.write_block(phys, PageBlock(**{**full.__dict__, "sub": None if sub else block["k"][:, :, :2]}))


def test_the_prefix_cache_stores_and_restores_through_device_pages(device):
    """An evicted prefix of a device-attached pool goes to the store and comes back bit for bit:
    the store is no longer skipped with a GPU storage."""
    config = CacheConfig(page_size=PS, num_pages=4, dtype="float32")
    pool = PagePool(config, L, H, D)
    pages = DevicePages(pool, torch.float32, device)
    pool.attach_storage(pages)
    ident = StoreIdentity(package="t", num_layers=L, num_kv_heads=H, page_size=PS, head_dim=D, dtype="float32")
    store = make_page_store("host", ident, host_bytes=1 << 20)
    cache = make_prefix_cache("hash", pool, store=store)
    rng = np.random.default_rng()

    def compute(tokens):
        new = pool.allocate(len(tokens) // PS)
        slots = np.array([[p * PS + i for p in new for i in range(PS)]])
        keys = [rng.standard_normal((1, H, slots.shape[1], D)).astype(np.float32) for _ in range(L)]
        pool.write_step(slots, keys, [-k for k in keys])
        cache.insert(tokens, new, [])
        data = [pages.read_block(int(pool._physical_ids(np.array([p]))[0])) for p in new]
        for p in reversed(new):
            pool.decref(p)
        return data

    tokens = list(range(8))
    data = compute(tokens)
    assert page_block(pool, 0, tokens[:PS], None) is not None  # exportable now
    compute([100 + i for i in range(4 * PS)])  # evicts both to the store
    assert store.num_entries == 2 and store.counters["puts"] == 2
    got, _ = cache.match(tokens + [0])
    assert len(got) == 2 and cache.last_match_tiers == {"host": 2}
    for page, want in zip(got, data):
        assert_blocks_equal(pages.read_block(int(pool._physical_ids(np.array([page]))[0])), want)
    pool.check_integrity([got], check_data=True)  # min/max read back from the device agree
    cache.check_integrity()
    cache.close()


def test_staging_buffers_are_reused_and_pinned_only_on_a_gpu(device):
    config = CacheConfig(page_size=PS, num_pages=3, dtype="float16")
    pool = PagePool(config, L, H, D)
    pages = DevicePages(pool, torch.float16, device)
    pool.attach_storage(pages)
    pages.read_block(0)
    copies = pages._store_copies
    bufs = {k: b.data_ptr() for k, b in copies._staging.items()}
    pages.read_block(1)
    assert {k: b.data_ptr() for k, b in copies._staging.items()} == bufs  # one set, reused
    assert all(b.is_pinned() == (device.type == "cuda") for b in copies._staging.values())
    assert (copies._side is not None) == (device.type == "cuda")
