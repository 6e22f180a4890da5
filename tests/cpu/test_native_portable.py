"""The native op built for a baseline CPU (no AVX2/FMA: the scalar and generic paths that ARM boards
such as Jetson, and old x86 CPUs, run) equals the numpy reference too. The default build
(-march=native) takes the AVX2 paths on this machine, so without this test the generic code would
never run in CI."""

from __future__ import annotations

import platform

import pytest

from tinyserve_dev.cases import CaseSpec, make_case
from tinyserve_trt.cpu import native
from tinyserve_trt.ops import schema

from .test_native_op import COLD_LAYOUTS, check_case, cold_case, ragged_lens, run_native

BASELINE = {"x86_64": "x86-64", "aarch64": "armv8-a"}.get(platform.machine())
pytestmark = pytest.mark.skipif(BASELINE is None or native.available() is not None,
                                reason=f"no baseline -march for {platform.machine()} or no native build")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return native.build(native.SOURCE_DIR, tmp_path_factory.mktemp("cache"), march=BASELINE)


def test_baseline_build_has_no_avx(lib):
    """The build really is another binary: a different cache key, no AVX (ymm) or FMA instructions in it
    (the -march=native build on this machine has both)."""
    assert lib != native.library_path()
    if BASELINE == "x86-64":
        import shutil
        import subprocess

        if shutil.which("objdump"):
            dis = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True).stdout
            assert "ymm" not in dis and "vfmadd" not in dis


@pytest.mark.parametrize("sp", [0, 4])
@pytest.mark.parametrize("group_reduce", schema.GROUP_REDUCTIONS)
def test_baseline_matches_reference(rng, lib, sp, group_reduce):
    ps = 16
    lens = ragged_lens(rng, ps)
    attrs = schema.OpAttributes(sub_page_size=sp, group_reduce=group_reduce, sink_pages=1, recent_pages=1)
    for budget in (ps, 3 * ps + 4, 10 * ps, 0):
        check_case(make_case(CaseSpec(lens, 6, 2, 32, ps, budget=budget, sub_page_size=sp), rng), attrs, lib)


@pytest.mark.parametrize("sp", [0, 4])
def test_baseline_smollm2_shapes_and_batch_one(rng, lib, sp):
    case = make_case(CaseSpec((3000, 1337), 9, 3, 64, 32, budget=512, sub_page_size=sp), rng)
    check_case(case, schema.OpAttributes(sub_page_size=sp), lib)
    for past in (1, 300, 977):  # batch 1: the attention split into chunks
        case = make_case(CaseSpec((past,), 9, 3, 64, 16, budget=64, sub_page_size=sp), rng)
        check_case(case, schema.OpAttributes(sub_page_size=sp), lib)


def test_baseline_odd_head_dim_and_dense(rng, lib):
    case = make_case(CaseSpec(ragged_lens(rng, 16), 6, 2, 20, 16, budget=40, sub_page_size=4), rng)
    check_case(case, schema.OpAttributes(sub_page_size=4), lib)
    case = make_case(CaseSpec(ragged_lens(rng, 16), 6, 2, 20, 16, budget=40), rng)
    check_case(case, schema.OpAttributes(), lib)
    check_case(case, schema.OpAttributes(policy="dense"), lib)


@pytest.mark.parametrize("layout", COLD_LAYOUTS[::3], ids=lambda x: "-".join(map(str, x)))
def test_baseline_cold_pages(rng, lib, layout):
    for sp in (0, 4):
        kw = dict(num_heads=6, num_kv_heads=2, head_dim=32, page_size=16, budget=52, sub_page_size=sp)
        check_case(cold_case(rng, ragged_lens(rng, 16), kw, layout), schema.OpAttributes(sub_page_size=sp,
                                                                                          cold_format=layout[0]), lib)


def test_baseline_and_native_builds_select_the_same_pages(rng, lib):
    case = make_case(CaseSpec((2000, 777, 64), 9, 3, 64, 32, budget=256, sub_page_size=4), rng)
    attrs = schema.OpAttributes(sub_page_size=4)
    assert (run_native(case, attrs, lib=lib)[1] == run_native(case, attrs)[1]).all()


def test_bad_arch_is_one_line(monkeypatch):
    monkeypatch.setenv(native.ENV_ARCH, "native; rm -rf /")
    with pytest.raises(native.NativeUnavailable, match=r"TINYSERVE_NATIVE_ARCH=.* is not a -march target name"):
        native.arch()


def test_unknown_arch_fails_the_build_with_one_line(tmp_path):
    with pytest.raises(native.NativeUnavailable, match=r"compiling libtinyserve_cpu.so failed: .*error"):
        native.build(native.SOURCE_DIR, tmp_path, march="no-such-cpu")


@pytest.mark.parametrize("layout", [None, COLD_LAYOUTS[0], COLD_LAYOUTS[3]], ids=str)
def test_baseline_prefill(rng, lib, layout):
    """The prefill's generic vectors (no FMA, scalar exp) on the baseline build."""
    kw = dict(num_heads=6, num_kv_heads=2, head_dim=32 if layout else 20, page_size=16, budget=16, new_tokens=37,
              sub_page_size=4)
    attrs = schema.OpAttributes(sub_page_size=4, cold_format=layout[0] if layout else "int8")
    case = cold_case(rng, ragged_lens(rng, 16), kw, layout) if layout else make_case(
        CaseSpec(ragged_lens(rng, 16), **kw), rng)
    check_case(case, attrs, lib)


AVX2_ONLY = {"x86_64": "x86-64-v3"}.get(platform.machine())  # AVX2 + FMA, no AVX-512


@pytest.mark.skipif(AVX2_ONLY is None, reason="no AVX2-only -march on this machine")
def test_avx2_build_prefill_and_decode(rng, tmp_path_factory):
    """The 8-lane paths (the prefill's ymm tiles, vexp) that an AVX-512 machine's -march=native
    build never takes."""
    lib = native.build(native.SOURCE_DIR, tmp_path_factory.mktemp("avx2"), march=AVX2_ONLY)
    for new_tokens, sp in ((1, 4), (45, 0), (45, 4)):
        case = make_case(CaseSpec((500, 37, 0), 14, 2, 64, 32, new_tokens=new_tokens, budget=128, sub_page_size=sp),
                         rng)
        check_case(case, schema.OpAttributes(sub_page_size=sp, group_reduce="head"), lib)
