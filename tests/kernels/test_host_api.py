"""Host-side entry points of libqsa_kernels that need no GPU: argument checks and workspace sizing."""

import ctypes
import subprocess
import sys

import pytest

from tinyserve_trt.kernels import library
from tinyserve_trt.ops import schema

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
        if name not in library.FORWARD_POINTERS[10:14]:
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


def test_int8_cold_pages_unsupported_for_now(host_lib):
    assert _check(host_lib, _params(key_cache_int8=ctypes.c_void_p(0x9000))) == 2


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
