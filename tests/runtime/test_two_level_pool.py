"""Two-level selection in the runtime: the pools keep ``key_sub_bounds`` by page id, equal to
``ops.fine_bounds.page_sub_bounds`` recomputed from scratch after appends, copy-on-write and
demotions (host numpy storage and DevicePages on CPU tensors); an exported two-level package
served end to end."""

import numpy as np
import pytest

from tinyserve_trt.ops.fine_bounds import page_sub_bounds
from tinyserve_trt.runtime.config import CacheConfig
from tinyserve_trt.runtime.pages import PagePool, PoolIntegrityError
from tinyserve_trt.runtime.tiers import TierConfig, TieredPagePool

PS, SP, L, H, D = 8, 2, 2, 2, 4


def _pool(dtype="float16", tiered=True):
    config = CacheConfig(page_size=PS, num_pages=6, dtype=dtype, sub_page_size=SP)
    return TieredPagePool(config, TierConfig(num_cold_pages=4), L, H, D) if tiered else PagePool(config, L, H, D)


def _append(pool, page, n, rng, start=0):
    for layer in range(L):
        k = (rng.standard_normal((n, H, D)) * (1 + 3 * (rng.random(D) < 0.3))).astype(pool.config.dtype)
        pool.write_tokens(layer, page * PS + np.arange(start, start + n), k, k + 1)


def _assert_codes_fresh(pool, pages):
    """Every page's stored codes == the encoder run from scratch on the keys the op reads."""
    for page in pages:
        phys = int(pool.physical_table(np.array([page]))[0])
        for layer in range(L):
            n = int(pool.num_valid(layer)[phys])
            keys, kmin, kmax = pool.storage.read_page(layer, phys)
            want = page_sub_bounds(keys, SP, kmin, kmax, n)
            np.testing.assert_array_equal(pool.storage.read_sub_bounds(layer, phys), want)
            assert pool.cache_inputs(layer)["key_sub_bounds"].shape == (pool.storage.num_hot + pool.storage.num_cold,
                                                                        H, PS // SP, D)


def test_codes_follow_appends_copies_and_demotions():
    rng = np.random.default_rng(1)
    pool = _pool()
    a, b = pool.allocate(2)
    for start, n in ((0, 1), (1, 2), (3, 5)):  # token by token, then chunks: every min/max change moves codes
        _append(pool, a, n, rng, start)
        _assert_codes_fresh(pool, [a])
    _append(pool, b, 3, rng)
    codes_before = pool.storage.read_sub_bounds(0, pool.physical(a)).copy()
    assert codes_before.any()  # not all code 0 (the coarse bounds): sub-pages really are tighter
    pool.demote(a)  # re-encoded from the dequantized keys against their new min/max
    _assert_codes_fresh(pool, [a, b])
    pool.incref(a)
    (c,) = pool.allocate(1)
    pool.copy_page(a, c)  # cold source: the copy's codes are the source's
    np.testing.assert_array_equal(pool.storage.read_sub_bounds(1, pool.physical(c)),
                                  pool.storage.read_sub_bounds(1, pool.physical(a)))
    _assert_codes_fresh(pool, [a, b, c])
    pool.check_integrity([[a], [a], [b], [c]], check_data=True)


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_write_step_equals_per_layer_writes(dtype, stacked):
    """One call for every layer (decode appends take ``append_bounds``' update path; a prefill
    chunk, an overwrite and a page's first token the full recompute) leaves K/V, min/max and
    sub-page codes bit-identical to ``write_batch`` layer by layer, and the codes fresh - given a
    list of layers or one stacked ``[L, B, Hkv, T, D]`` array (the ORT backend's bound outputs)."""
    rng = np.random.default_rng(3)
    step_pool, layer_pool = _pool(dtype, tiered=False), _pool(dtype, tiered=False)
    pages = [step_pool.allocate(2) for _ in range(2)]
    assert pages == [layer_pool.allocate(2) for _ in range(2)]
    (a0, a1), (b0, b1) = pages
    lens = [0, 0]

    def step(new: list[int], overwrite: bool = False):
        width = max(new)
        slots = np.full((2, width), -1, np.int64)
        for row, ((p0, p1), n) in enumerate(zip(pages, new)):
            pos = np.arange(lens[row] - overwrite, lens[row] - overwrite + n)
            slots[row, :n] = np.where(pos < PS, p0 * PS + pos, p1 * PS + pos - PS)
            lens[row] += n - overwrite
        ks = [(rng.standard_normal((2, H, width, D)) * (1 + 3 * (rng.random(D) < 0.3))).astype(dtype)
              for _ in range(L)]
        vs = [k + 1 for k in ks]
        step_pool.write_step(slots, np.stack(ks) if stacked else ks, np.stack(vs) if stacked else vs)
        for layer, k in enumerate(ks):
            layer_pool.write_batch(layer, slots, k, k + 1)

    step([3, 1])  # prefill chunk / a first token
    for new in ([1, 1],) * 7 + ([2, 1],):  # decode appends, across the page boundary; then a chunk
        step(new)
    step([1, 1], overwrite=True)  # rewrites each row's last token: recomputed, not updated
    step([1, 1])
    for name in ("_k", "_v", "_key_min", "_key_max", "_sub"):
        np.testing.assert_array_equal(getattr(step_pool.storage, name), getattr(layer_pool.storage, name), name)
    np.testing.assert_array_equal(step_pool.num_valid(1), layer_pool.num_valid(1))
    _assert_codes_fresh(step_pool, [a0, a1, b0, b1])
    step_pool.check_integrity([[a0, a1], [b0, b1]], check_data=True)


def test_integrity_catches_stale_codes():
    rng = np.random.default_rng(2)
    pool = _pool(tiered=False)
    (a,) = pool.allocate(1)
    _append(pool, a, 5, rng)
    pool.check_integrity([[a]], check_data=True)
    pool.cache_inputs(1)["key_sub_bounds"][a, 0, 0, 0] ^= 0x11
    with pytest.raises(PoolIntegrityError, match="sub-page bounds are stale"):
        pool.check_integrity([[a]], check_data=True)


def test_storage_geometry_and_validation():
    with pytest.raises(ValueError, match="sub_page_size"):
        CacheConfig(page_size=8, sub_page_size=3)
    with pytest.raises(ValueError, match="sub_page_size"):
        CacheConfig(page_size=8, sub_page_size=8)
    plain = PagePool(CacheConfig(page_size=PS, num_pages=2), L, H, D)
    assert "key_sub_bounds" not in plain.cache_inputs(0) and "key_sub_bounds" not in plain.storage.roles
    two = _pool(tiered=False)
    assert "key_sub_bounds" in two.storage.roles and two.cache_inputs(0)["key_sub_bounds"].dtype == np.uint8
    with pytest.raises(ValueError, match="sub-page"):
        plain.attach_storage(two.storage)


def test_device_pages_keep_the_same_codes_as_the_host():
    torch = pytest.importorskip("torch")
    from tinyserve_trt.runtime.backends.device_pages import DevicePages

    host, dev = _pool("float32"), _pool("float32")
    dev.attach_storage(DevicePages(dev, torch.float32, torch.device("cpu"),
                                   dict(k_granularity="channel", v_granularity="token")))
    for pool in (host, dev):
        rng = np.random.default_rng(3)
        a, b = pool.allocate(2)
        _append(pool, a, PS, rng)
        _append(pool, b, 3, rng)
        pool.demote(a)
        pool.incref(a)
        (c,) = pool.allocate(1)
        pool.copy_page(a, c)
        pool.check_integrity([[a], [a], [b], [c]], check_data=True)
    for layer in range(L):
        np.testing.assert_array_equal(dev.cache_inputs(layer)["key_sub_bounds"].numpy(),
                                      host.cache_inputs(layer)["key_sub_bounds"])
    # after an append kernel wrote tokens + min/max itself, the pool has the storage refresh the codes
    (d,) = dev.allocate(1)
    t = dev.storage.layers
    rng = np.random.default_rng(4)
    for layer in range(L):
        k = torch.from_numpy(rng.standard_normal((H, 3, D)).astype(np.float32))
        phys = dev.physical(d)
        t[layer]["key_cache"][phys, :, :3] = k
        t[layer]["key_min"][phys], t[layer]["key_max"][phys] = k.amin(1), k.amax(1)
    dev.note_device_writes(np.array([[d * PS, d * PS + 1, d * PS + 2]]))
    _assert_codes_fresh(dev, [d])


@pytest.fixture(scope="module")
def two_level_package(tiny_root):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.tiny_models import build_package

    root = tiny_root / "llama-two-level"
    root.mkdir(exist_ok=True)
    _, pkg = build_package("llama", root, page_size=8, sub_page_size=2, token_budget=16)
    return pkg


def test_two_level_package_served_end_to_end(two_level_package):
    """ORT binds each sparse layer's key_sub_bounds from the pool: at a budget covering the
    context the greedy ids equal the dense run's; at a small budget sparse decode runs, selects
    (some pages left out), and the pool's codes stay exact."""
    from tinyserve_trt import LLM, SamplingParams
    from tinyserve_trt.runtime.model_package import ModelPackage

    package = ModelPackage.load(two_level_package)
    assert package.sub_page_size == 2
    assert all(("key_sub_bounds" in layer) == (layer["policy"] != "dense") for layer in package.layers)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = [(i * 37 + 11) % 256 for i in range(41)]
    dense = LLM(two_level_package, dense=True).generate(prompt_token_ids=[prompt], params=greedy)
    wide = LLM(two_level_package, token_budget=4096).generate(prompt_token_ids=[prompt], params=greedy)
    assert wide[0].outputs[0].token_ids == dense[0].outputs[0].token_ids
    llm = LLM(two_level_package, token_budget=8)
    assert "key_sub_bounds" in llm.engine.pool.cache_inputs(1)
    out = llm.generate(prompt_token_ids=[prompt, prompt[:30]], params=greedy)
    assert all(len(o.outputs[0].token_ids) == 24 for o in out)
    assert llm.stats()["page_selection_rate"] < 1.0
    llm.engine.pool.check_integrity(check_data=True)


def test_package_two_level_fields_are_checked(two_level_package, tmp_path):
    """The manifest's sub_page_size and the sparse layers' key_sub_bounds role must agree; a bad
    value is one PackageError line."""
    import json
    import shutil

    from tinyserve_trt.runtime.model_package import ModelPackage, PackageError

    def load_with(edit):
        pkg = tmp_path / "pkg"
        shutil.rmtree(pkg, ignore_errors=True)
        shutil.copytree(two_level_package, pkg)
        manifest = json.loads((pkg / "tinyserve.json").read_text())
        edit(manifest)
        (pkg / "tinyserve.json").write_text(json.dumps(manifest))
        return ModelPackage.load(pkg)

    with pytest.raises(PackageError, match="sub_page_size must be 0 or a proper divisor"):
        load_with(lambda m: m.update(sub_page_size=3))
    with pytest.raises(PackageError, match="has 'key_sub_bounds' but sub_page_size is 0"):
        load_with(lambda m: m.pop("sub_page_size"))
    with pytest.raises(PackageError, match="lacks 'key_sub_bounds'"):
        load_with(lambda m: m["io"]["layers"][-1].pop("key_sub_bounds"))
