"""The native page_bounds (cpu/append.py, csrc/qsa_append.cpp) equals the numpy path of a prefill
write (host_storage's _refresh_minmax over every layer) bit for bit: key min, max and sub-page
codes of pages with any valid count, ties and zero-width channels included; the host storage takes
it for a float32 pool and keeps numpy for float16; bad input fails with one line."""

from __future__ import annotations

import numpy as np
import pytest

from tinyserve_trt.cpu import append as native_append
from tinyserve_trt.cpu import native
from tinyserve_trt.runtime.host_storage import HostKVStorage

from .test_native_append import KINDS, _keys

_REASON = native.available()
needs_native = pytest.mark.skipif(_REASON is not None, reason=f"native library unavailable: {_REASON}")
L, H, PS, D = 3, 2, 8, 12


def _store(sub: int, dtype="float32") -> HostKVStorage:
    return HostKVStorage(L, 6, H, PS, D, dtype, sub_page_size=sub)


def _bounds(st: HostKVStorage):
    return [a.copy() for a in (st._key_min, st._key_max) + ((st._sub,) if st.sub_page_size else ())]


@needs_native
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sub", [0, 1, 2, 4])
def test_matches_numpy_refresh(kind, sub):
    rng = np.random.default_rng(sub * 10 + len(kind))
    ref, nat = _store(sub), _store(sub)
    keys = _keys(rng, kind, ref._k.shape) * 7  # garbage past each page's valid count too
    ref._k[...] = nat._k[...] = keys
    pages = np.array([4, 0, 2, 5])
    valid = rng.integers(0, PS + 1, (L, len(pages)))
    valid[0] = [0, 1, PS, 3]  # an empty page, one token, a full page
    ref._refresh_minmax(slice(None), pages, ref._k[:, pages], valid)
    native_append.page_bounds(nat._k, nat._key_min, nat._key_max, nat._sub if sub else None, pages, valid)
    for a, b in zip(_bounds(ref), _bounds(nat)):
        np.testing.assert_array_equal(a, b)
    assert np.array_equal(nat._key_min[1:, 1], ref._key_min[1:, 1])  # pages not named are untouched


@needs_native
@pytest.mark.parametrize("dtype,native_calls", [("float32", 1), ("float16", 0)])
def test_prefill_write_takes_the_native_path(monkeypatch, dtype, native_calls):
    calls = []
    real = native_append.page_bounds
    monkeypatch.setattr(native_append, "page_bounds", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(3)
    st, ref = _store(4, dtype), _store(4, dtype)
    slots = np.arange(2 * PS + 3)  # pages 0-2, the last partly
    k = rng.standard_normal((L, len(slots), H, D)).astype(dtype)
    pages, valid = np.array([0, 1, 2]), np.tile([PS, PS, 3], (L, 1))
    st.write_layers(slots, k, k, pages, valid)
    ref._k[:, slots // PS, :, slots % PS, :] = np.swapaxes(k, 0, 1)
    ref._refresh_minmax(slice(None), pages, ref._k[:, pages], valid)
    assert len(calls) == native_calls
    for a, b in zip(_bounds(ref), _bounds(st)):
        np.testing.assert_array_equal(a, b)


@needs_native
@pytest.mark.parametrize("case,match", [
    ("dtype", "float32 C-contiguous"),
    ("page", "page id is outside"),
    ("valid", "valid count is outside"),
    ("valid_shape", "valid must be"),
])
def test_bad_input_is_one_line(case, match):
    st = _store(4)
    pages, valid = np.array([0, 1]), np.full((L, 2), 3)
    keys = st._k
    if case == "dtype":
        keys = keys.astype(np.float16)
    elif case == "page":
        pages = np.array([0, 6])
    elif case == "valid":
        valid[1, 0] = PS + 1
    else:
        valid = valid[:, :1]
    with pytest.raises(ValueError, match=match) as e:
        native_append.page_bounds(keys, st._key_min, st._key_max, st._sub, pages, valid)
    assert "\n" not in str(e.value)


def test_a_library_without_page_bounds_is_not_picked_up():
    """native.SYMBOLS names every function append.py looks up: a cached or prebuilt library from
    before page_bounds is refused (and rebuilt) instead of failing at the first prefill write."""
    assert {native_append.SYMBOL, native_append.PAGES_SYMBOL} <= set(native.SYMBOLS)
