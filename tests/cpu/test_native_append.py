"""The native append_bounds (cpu/append.py, csrc/qsa_append.cpp) equals the numpy reference
(runtime/append_bounds.py::append_bounds_numpy) bit for bit: key min, max and sub-page codes after
every decode step of pages filled from empty to full; the runtime takes it when it can and falls
back with TINYSERVE_NATIVE=0 or a float16 pool; bad input fails with one line."""

from __future__ import annotations

import numpy as np
import pytest

from tinyserve_trt.cpu import append as native_append
from tinyserve_trt.cpu import native
from tinyserve_trt.ops.fine_bounds import pages_sub_bounds
from tinyserve_trt.runtime import append_bounds as runtime_append

_REASON = native.available()
needs_native = pytest.mark.skipif(_REASON is not None, reason=f"native library unavailable: {_REASON}")

L, H = 3, 2
KINDS = ("normal", "negative", "equal")


def _keys(rng, kind: str, shape) -> np.ndarray:
    """normal: scaled channels; negative: all below zero; equal: few distinct values (ties, bounds
    that do not move, zero-width pages)."""
    if kind == "normal":
        x = rng.standard_normal(shape) * (1 + 5 * (rng.random(shape[-1]) < 0.3))
    elif kind == "negative":
        x = -np.abs(rng.standard_normal(shape)) * 3 - 0.5
    else:
        x = rng.integers(-2, 3, shape) * 0.75
    return x.astype(np.float32)


class State:
    """A float32 pool ``[L, N, H, ps, D]`` with bounds and codes, garbage past each page's valid count."""

    def __init__(self, rng, n_pages: int, ps: int, d: int, r: int | None):
        self.ps, self.r = ps, r
        self.keys = (rng.standard_normal((L, n_pages, H, ps, d)) * 100).astype(np.float32)  # never read
        self.key_min = np.zeros((L, n_pages + 2, H, d), np.float32)  # + 2: the cold pages' slots
        self.key_max = np.zeros_like(self.key_min)
        self.sub = None if r is None else np.zeros((L, n_pages + 2, H, r, d), np.uint8)
        self.valid = np.zeros(n_pages, np.int64)

    def copy(self) -> "State":
        other = object.__new__(State)
        other.__dict__ = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in self.__dict__.items()}
        return other

    def write(self, page: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Write ``k [L, T, H, D]`` at each page's valid count; return the offsets."""
        off = self.valid[page].copy()
        self.keys[:, page, :, off, :] = np.swapaxes(k, 0, 1)
        self.valid[page] += 1
        return off

    def args(self):
        return self.keys, self.key_min, self.key_max, self.sub


def _assert_same(a: State, b: State) -> None:
    assert np.array_equal(a.key_min, b.key_min) and np.array_equal(a.key_max, b.key_max)
    if a.sub is not None:
        assert np.array_equal(a.sub, b.sub)


def _assert_fresh(s: State, pages) -> None:
    """The updated bounds equal a from-scratch recompute (the reference's own contract)."""
    for p in pages:
        n = int(s.valid[p])
        keys = s.keys[:, p, :, :n]
        np.testing.assert_array_equal(s.key_min[:, p], keys.min(axis=2))
        np.testing.assert_array_equal(s.key_max[:, p], keys.max(axis=2))
        if s.sub is not None:
            want = pages_sub_bounds(s.keys[:, p], s.ps // s.r, s.key_min[:, p], s.key_max[:, p], np.full(L, n))
            np.testing.assert_array_equal(s.sub[:, p], want)


def _fill(rng, ps: int, r: int | None, d: int, kind: str, n_pages: int = 6) -> int:
    """Decode steps of several tokens on distinct pages until every page is full; returns the steps."""
    ref = State(rng, n_pages, ps, d, r)
    nat = ref.copy()
    steps = 0
    while (ref.valid < ps).any():
        open_pages = np.flatnonzero(ref.valid < ps)
        page = rng.permutation(open_pages)[: int(rng.integers(1, len(open_pages) + 1))]
        k = _keys(rng, kind, (L, len(page), H, d))
        off = ref.write(page, k)
        assert np.array_equal(nat.write(page, k), off)
        runtime_append.append_bounds_numpy(*ref.args(), page, off, k)
        native_append.append_bounds(*nat.args(), page, off, k)
        _assert_same(ref, nat)
        steps += 1
    _assert_fresh(ref, range(n_pages))
    return steps


@needs_native
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ps,r,d", [(8, 1, 16), (8, 2, 12), (8, 8, 16), (32, 8, 64)])
def test_matches_numpy_filling_pages(kind, ps, r, d):
    assert _fill(np.random.default_rng(ps * 100 + r + len(kind)), ps, r, d, kind) >= ps


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_matches_numpy_single_level(kind):
    assert _fill(np.random.default_rng(7), 8, None, 20, kind) >= 8


@needs_native
def test_moved_bound_recodes_earlier_sub_pages():
    """A later token past the page's max re-encodes every written sub-page of that channel."""
    rng = np.random.default_rng(5)
    ref = State(rng, 2, 8, 4, 4)
    for _ in range(6):
        page = np.array([0])
        k = _keys(rng, "normal", (L, 1, H, 4))
        runtime_append.append_bounds_numpy(*ref.args(), page, ref.write(page, k), k)
    nat = ref.copy()
    before = ref.sub.copy()
    k = np.full((L, 1, H, 4), 50.0, np.float32)  # above every key: each channel's max moves
    off = ref.write(np.array([0]), k)
    nat.write(np.array([0]), k)
    runtime_append.append_bounds_numpy(*ref.args(), np.array([0]), off, k)
    native_append.append_bounds(*nat.args(), np.array([0]), off, k)
    _assert_same(ref, nat)
    assert not np.array_equal(ref.sub[:, 0, :, :3], before[:, 0, :, :3])  # the earlier sub-pages changed
    _assert_fresh(nat, [0])


@needs_native
def test_runtime_takes_the_native_path(monkeypatch):
    calls = []
    real = native_append.append_bounds
    monkeypatch.setattr(native_append, "append_bounds", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(11)
    s = State(rng, 3, 8, 8, 2)
    page = np.array([2, 0])
    k = _keys(rng, "normal", (L, 2, H, 8))
    runtime_append.append_bounds(*s.args(), page, s.write(page, k), k)
    assert calls == [1]
    _assert_fresh(s, [0, 2])


@pytest.mark.parametrize("how", ["env", "float16"])
def test_runtime_falls_back_to_numpy(monkeypatch, how):
    calls = []
    monkeypatch.setattr(native_append, "append_bounds", lambda *a: calls.append(1))
    rng = np.random.default_rng(12)
    s = State(rng, 3, 8, 8, 2)
    if how == "env":
        monkeypatch.setenv(native.ENV_DISABLE, "0")
    else:
        s.keys, s.key_min, s.key_max = (a.astype(np.float16) for a in (s.keys, s.key_min, s.key_max))
    page = np.array([1])
    k = _keys(rng, "normal", (L, 1, H, 8)).astype(s.keys.dtype)
    runtime_append.append_bounds(*s.args(), page, s.write(page, k), k)
    assert calls == []
    _assert_fresh(s, [1])  # the numpy path did the update


@needs_native
@pytest.mark.parametrize("case,match", [
    ("dtype", "float32 C-contiguous"),
    ("page", "page id is outside"),
    ("off", "offset is outside"),
    ("shared", "share a page"),
    ("k_shape", "k must be"),
    ("stale", "outside the page's key_min/key_max"),
])
def test_bad_input_is_one_line(case, match):
    rng = np.random.default_rng(13)
    s = State(rng, 3, 8, 8, 2)
    page, off = np.array([0, 1]), np.array([0, 0])
    k = _keys(rng, "normal", (L, 2, H, 8))
    s.write(page, k)
    if case == "dtype":
        k = k.astype(np.float64)
    elif case == "page":
        page = np.array([0, 3])
    elif case == "off":
        off = np.array([0, 8])
    elif case == "shared":
        page = np.array([1, 1])
    elif case == "k_shape":
        k = k[:, :1]
    elif case == "stale":  # bounds that miss the page's earlier token (as after a lost update)
        native_append.append_bounds(*s.args(), page, off, k)
        k2 = _keys(rng, "normal", (L, 1, H, 8))
        off = s.write(np.array([0]), k2)
        s.key_min[:, 0] = s.key_max[:, 0] = 1000.0
        page, k = np.array([0]), k2
    ref = s.copy()
    with pytest.raises(ValueError, match=match) as info:
        native_append.append_bounds(*s.args(), page, off, k)
    assert "\n" not in str(info.value)
    if case == "stale":  # the reference refuses it the same way
        with pytest.raises(ValueError, match=match):
            runtime_append.append_bounds_numpy(*ref.args(), page, off, k)
