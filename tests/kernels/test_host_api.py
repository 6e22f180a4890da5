"""Host-side entry points of libqsa_kernels that need no GPU: argument checks and workspace sizing."""

import ctypes
import subprocess
import sys

import pytest

from tinyserve_trt.cuda import library
from tinyserve_trt.ops import schema
from tinyserve_dev.cases import CaseSpec, make_mixed_case

from .conftest import ROOT, nvcc_or_skip


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    nvcc_or_skip()
    out = tmp_path_factory.mktemp("qsa")
    subprocess.run([sys.executable, str(ROOT / "plugins" / "build.py"), "--arch", "80", "--out", str(out)],
                   check=True, capture_output=True)
    return library.load(out / "libqsa_kernels.so")


def _params(attrs=schema.OpAttributes(), S=1, **over):
    p = library.QsaForwardParams()
    p.dims = library.QsaDims(2, 8, 2, S, 64, 10, 16, 4, 10)
    p.attrs = library.make_attrs(attrs)
    p.dtype = 0
    p.selected_pages_elem_size = 1
    for i, name in enumerate(library.FORWARD_POINTERS):  # fake non-null pointers: qsa_check never dereferences
        if name not in library.COLD_POINTERS:
            setattr(p, name, ctypes.c_void_p(0x1000 + 0x100 * i))
    for k, v in over.items():
        setattr(p, k, v)
    return p


def _check(lib, p):
    return lib.qsa_check(ctypes.byref(p))


def test_valid_call_passes(host_lib):
    assert _check(host_lib, _params()) == 0


@pytest.mark.parametrize("attrs,S,status", [(schema.OpAttributes(policy="oracle"), 1, 2),
                                            (schema.OpAttributes(policy="oracle"), 4, 0)])
def test_oracle_is_reference_only_for_decode(host_lib, attrs, S, status):
    assert _check(host_lib, _params(attrs, S)) == status


@pytest.mark.parametrize("S", [1, 4])
def test_per_head_selection_is_accepted(host_lib, S):
    """group_reduce "head" (each query head selects alone): decode and prefill both run."""
    assert _check(host_lib, _params(schema.OpAttributes(group_reduce="head"), S)) == 0
    assert _check(host_lib, _params(schema.OpAttributes(group_reduce="head", sub_page_size=4), S,
                                    dims=library.QsaDims(2, 8, 2, S, 64, 10, 16, 4, 10, 4))) == 0


@pytest.mark.parametrize("attrs,S,rows", [(schema.OpAttributes(group_reduce="head"), 1, 8),
                                          (schema.OpAttributes(group_reduce="head"), 4, 2),  # prefill: no selection
                                          (schema.OpAttributes(group_reduce="head", policy="window"), 1, 2),
                                          (schema.OpAttributes(group_reduce="max"), 1, 2)])
def test_kept_rows_per_query_head_only_where_the_query_selects(host_lib, attrs, S, rows):
    """A kept-list row per query head (H = 8) for a per-head decode, else one per KV head (Hkv = 2):
    window and dense select the same pages for every head of a group."""
    assert host_lib.qsa_kept_rows(ctypes.byref(_params(attrs, S))) == rows


def test_per_head_grid_limit(host_lib):
    """A decode block per query head: grid y holds at most 65535 of them."""
    head = schema.OpAttributes(group_reduce="head")
    p = _params(head, dims=library.QsaDims(1, 65536, 1, 1, 1, 10, 16, 4, 10))
    assert _check(host_lib, p) == 1
    p.dims.num_heads = 65535
    assert _check(host_lib, p) == 0
    assert _check(host_lib, _params(head, 4, dims=library.QsaDims(1, 65536, 1, 4, 1, 10, 16, 4, 10))) == 0


def test_workspace_does_not_depend_on_group_reduce(host_lib):
    """Sized from the dims for a kept-list row per query head: a plugin sizes it before it knows the rule."""
    d = library.QsaDims(2, 8, 2, 1, 64, 10, 16, 4, 10, 4)
    idx, cnt = ctypes.c_size_t(), ctypes.c_size_t()
    width = host_lib.qsa_workspace_kept(ctypes.byref(d), ctypes.byref(idx), ctypes.byref(cnt))
    assert cnt.value - idx.value >= 2 * 8 * width * 4  # B * H rows of kept units


def _fake_pointers(names):
    return {n: 0x1000 + 0x100 * i for i, n in enumerate(names)}


@pytest.mark.parametrize("granularity", [("channel", "token"), ("head", "head"), ("token", "channel")])
@pytest.mark.parametrize("S", [1, 3])
def test_cold_tier_packed_from_a_mixed_case_passes(host_lib, rng, granularity, S):
    """What the GPU harness hands qsa_forward for a hot + INT8 case is accepted as is."""
    case = make_mixed_case(CaseSpec((40, 7), 4, 2, 16, 8, S, "float32", 16), rng, 0.5, *granularity)
    p = library.forward_params({n: a.shape for n, a in case.items()},
                               _fake_pointers([*case, "output", "selected_pages"]), "float32", schema.OpAttributes())
    assert p.cold.num_pages == case["key_cache_int8"].shape[0] >= 1
    assert _check(host_lib, p) == 0


def _cold_params(**cold):
    p = _params()
    p.dims.num_meta_pages = p.dims.num_pages + 3
    p.cold = library.QsaColdDims(3, 1, 64, 16, 1)  # K per channel, V per token (ps 16, D 64)
    for i, name in enumerate(library.COLD_POINTERS):
        setattr(p, name, ctypes.c_void_p(0x9000 + 0x100 * i))
    for k, v in cold.items():
        setattr(p.cold, k, v)
    return p


def test_cold_tier_checks(host_lib):
    assert _check(host_lib, _cold_params()) == 0
    assert _check(host_lib, _cold_params(key_scale_tokens=16, key_scale_channels=64)) == 0  # one per element
    p = _cold_params()
    p.value_scale = None  # the four pointers come together
    assert _check(host_lib, p) == 1
    assert _check(host_lib, _params(key_cache_int8=ctypes.c_void_p(0x9000))) == 1
    p = _params()
    p.cold.num_pages = 2  # a cold page count without cold pools
    assert _check(host_lib, p) == 1
    for bad in (dict(num_pages=0), dict(key_scale_tokens=4), dict(value_scale_channels=32),
                dict(key_scale_channels=0)):
        assert _check(host_lib, _cold_params(**bad)) == 1, bad
    p = _cold_params()
    p.dims.num_meta_pages = p.dims.num_pages + 2  # key_min/key_max lack a row for the last cold id
    assert _check(host_lib, p) == 1


@pytest.mark.parametrize("field,value", [("num_kv_heads", 3), ("head_dim", 512), ("page_size", 0),
                                         ("num_meta_pages", 5)])
def test_bad_dims_refused(host_lib, field, value):
    p = _params()
    setattr(p.dims, field, value)
    assert _check(host_lib, p) == 1


def test_bad_attrs_refused(host_lib):
    p = _params()
    p.attrs.recent_pages = 0
    assert _check(host_lib, p) == 1
    p = _params()
    p.attrs.policy = len(schema.POLICIES)
    assert _check(host_lib, p) == 1


def test_missing_pointer_refused(host_lib):
    assert _check(host_lib, _params(output=None)) == 1


def test_workspace_grows_with_dims_and_forward_refuses_small_one(host_lib):
    small = library.QsaDims(1, 8, 2, 1, 64, 10, 16, 4, 10)
    big = library.QsaDims(8, 8, 2, 1, 64, 10, 16, 400, 10)
    a, b = host_lib.qsa_workspace_size(ctypes.byref(small)), host_lib.qsa_workspace_size(ctypes.byref(big))
    assert 0 < a < b
    p = _params()
    # fails before any launch, so no GPU is touched
    assert host_lib.qsa_forward(ctypes.byref(p), None, 0, None) == 3


def test_num_splits_bounds(host_lib):
    d = library.QsaDims(1, 8, 2, 1, 64, 10, 16, 4096, 10)
    assert host_lib.qsa_num_splits(ctypes.byref(d), 0, 132) == 64  # capped at QSA_MAX_SPLITS
    assert host_lib.qsa_num_splits(ctypes.byref(d), 5, 132) == 5
    d.table_width = 3
    assert host_lib.qsa_num_splits(ctypes.byref(d), 0, 132) == 3  # never more splits than pages


def test_policy_ids_outside_the_implemented_set_are_refused(host_lib):
    """An id past the schema's list is invalid; the attribute is never run as another policy."""
    p = _params()
    p.attrs.policy = len(schema.POLICIES)
    assert _check(host_lib, p) == 1
    p.attrs.policy = -1
    assert _check(host_lib, p) == 1


@pytest.mark.parametrize("flags,status", [(0, 0), (1, 5), (2, 6), (3, 5)])
def test_flags_status_matches_python(host_lib, flags, status):
    host_lib.qsa_flags_status.argtypes = [ctypes.c_int32]
    host_lib.qsa_flags_status.restype = ctypes.c_int32
    assert host_lib.qsa_flags_status(flags) == status == library.flags_status(flags)


def _two_level_params():
    p = _params(schema.OpAttributes(sub_page_size=4, candidate_share=0.25))
    p.dims.sub_pages = 4  # r = ps 16 / sp 4 rows of key_sub_bounds per page
    return p


def test_two_level_checks(host_lib):
    assert _check(host_lib, _two_level_params()) == 0
    p = _two_level_params()
    p.key_sub_bounds = None  # two-level reads the fine bounds
    assert _check(host_lib, p) == 1
    p = _two_level_params()
    p.dims.sub_pages = 2  # key_sub_bounds rows disagree with ps / sub_page_size
    assert _check(host_lib, p) == 1
    for field, value in (("sub_page_size", 5), ("sub_page_size", 32), ("policy", 1), ("candidate_share", 1.5),
                         ("candidate_share", float("nan"))):
        p = _two_level_params()
        setattr(p.attrs, field, value)
        assert _check(host_lib, p) == 1, (field, value)
    # sub_page_size == ps is single-level: no fine bounds needed, r not read
    assert _check(host_lib, _params(schema.OpAttributes(sub_page_size=16), key_sub_bounds=None)) == 0


def test_workspace_kept_list_layout(host_lib):
    """The kept list has room for every sub-page of a full table; tests read it at these offsets."""
    single = library.QsaDims(2, 8, 2, 1, 64, 10, 16, 4, 10, 0)
    two = library.QsaDims(2, 8, 2, 1, 64, 10, 16, 4, 10, 4)
    idx, cnt = ctypes.c_size_t(), ctypes.c_size_t()
    assert host_lib.qsa_workspace_kept(ctypes.byref(single), ctypes.byref(idx), ctypes.byref(cnt)) == 4
    assert idx.value == 0 and cnt.value >= 2 * 2 * 4 * 4
    assert host_lib.qsa_workspace_kept(ctypes.byref(two), ctypes.byref(idx), ctypes.byref(cnt)) == 16
    assert cnt.value >= 2 * 2 * 16 * 4
    assert host_lib.qsa_workspace_size(ctypes.byref(two)) > host_lib.qsa_workspace_size(ctypes.byref(single))
    two.sub_pages = 17  # more sub-pages than tokens per page
    assert host_lib.qsa_workspace_kept(ctypes.byref(two), ctypes.byref(idx), ctypes.byref(cnt)) == 0
