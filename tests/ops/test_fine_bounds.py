"""Compact sub-page bounds: every decoded sub-page score bounds q.k of every key the op attends."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tinyserve_trt.ops import fine_bounds
from tinyserve_trt.ops.cold_codec import ColdCodec
from tinyserve_trt.ops.quantization import GRANULARITIES
from tinyserve_trt.ops.reference import page_min_max

PS, D = 16, 8
# magnitudes from tiny to huge, repeated values and exact zeros: where float32 rounding bites
_VALUES = st.one_of(st.floats(-1e4, 1e4, width=32), st.sampled_from([0.0, 1.0, -1.0, 1e-7, 65504.0, 0.1]))


def _check_bounds(keys, valid, sub_page_size, q):
    """keys [Hkv, ps, D] as the op attends them; asserts lo <= k <= hi and the score bound."""
    kmin, kmax = page_min_max(keys.transpose(1, 0, 2), valid)  # [Hkv, D] over the valid tokens
    codes = fine_bounds.page_sub_bounds(keys, sub_page_size, kmin, kmax, valid)
    assert codes.dtype == np.uint8 and codes.shape == (keys.shape[0], PS // sub_page_size, keys.shape[2])
    lo, hi = fine_bounds.decode(codes, kmin, kmax)  # float32, as the op decodes
    lo, hi = lo.astype(np.float64), hi.astype(np.float64)
    for t in range(valid):
        s = t // sub_page_size
        k = keys[:, t].astype(np.float32).astype(np.float64)  # the op computes in float32
        assert np.all(lo[:, s] <= k) and np.all(k <= hi[:, s]), (t, s)
        score = np.maximum(q * lo[:, s], q * hi[:, s]).sum(-1)  # [Hkv]
        assert np.all(score >= (q * k).sum(-1))  # rounding is monotone: no tolerance needed
    assert np.all(lo >= kmin.astype(np.float64)[:, None]) and np.all(hi <= kmax.astype(np.float64)[:, None])


@settings(max_examples=150, deadline=None)
@given(keys=arrays(np.float32, (2, PS, D), elements=_VALUES), q=arrays(np.float64, (2, D), elements=st.floats(-8, 8)),
       valid=st.integers(1, PS), sub=st.sampled_from([1, 2, 4, 8, 16]), half=st.booleans())
def test_hot_page_bounds_never_underestimate(keys, q, valid, sub, half):
    if half:
        keys = keys.clip(-60000, 60000).astype(np.float16)
    _check_bounds(keys, valid, sub, q)


@settings(max_examples=100, deadline=None)
@given(keys=arrays(np.float32, (2, PS, D), elements=st.floats(-50, 50, width=32)),
       q=arrays(np.float64, (2, D), elements=st.floats(-8, 8)), valid=st.integers(1, PS),
       sub=st.sampled_from([2, 4, 8]), granularity=st.sampled_from(GRANULARITIES),
       dtype=st.sampled_from(["float32", "float16"]))
def test_cold_page_bounds_cover_the_dequantized_keys(keys, q, valid, sub, granularity, dtype):
    """A cold page's bounds are those of the keys the op dequantizes (``cases.make_mixed_case``)."""
    codec = ColdCodec("int8", granularity, granularity)
    qk, scale = codec.quantize(keys.astype(dtype), "k", valid)
    _check_bounds(codec.dequantize(qk, scale, dtype), valid, sub, q)


def test_random_pages_and_tightness(rng):
    """Also on realistic keys (outlier channels), and the bound is much tighter than the page's."""
    keys = (rng.standard_normal((4, PS, 64)) * (1 + 4 * (rng.random(64) < 0.1))).astype(np.float32)
    for _ in range(20):
        _check_bounds(keys, PS, 4, rng.standard_normal((4, 64)))
    kmin, kmax = page_min_max(keys.transpose(1, 0, 2))
    lo, hi = fine_bounds.decode(fine_bounds.page_sub_bounds(keys, 4, kmin, kmax), kmin, kmax)
    assert ((hi - lo).mean() / (kmax - kmin).mean()) < 0.8  # 4 of 16 tokens span less of the range


def test_keys_on_the_decode_grid(rng):
    """Keys exactly on ``kmin + c * step`` (computed in float64): a float64 floor alone picks a code
    whose float32 decode lands ~1 ulp inside for ~1% of them; the encoder must widen those."""
    for _ in range(10):
        scale = 10.0 ** rng.uniform(-3, 3, (4, 1, 64))
        lo_row = rng.standard_normal((4, 1, 64)) * scale
        span = np.abs(rng.standard_normal((4, 1, 64))) * scale
        kmin, kmax = lo_row.astype(np.float32), (lo_row + span).astype(np.float32)
        step = ((kmax - kmin) * fine_bounds.INV_LEVELS).astype(np.float64)
        grid = kmin + rng.integers(0, 16, (4, PS, 64)) * step
        keys = np.clip(grid, kmin, kmax).astype(np.float32)
        keys[:, 0], keys[:, -1] = kmin[:, 0], kmax[:, 0]
        _check_bounds(keys, PS, 4, rng.standard_normal((4, 64)))


def test_code_zero_is_the_page_bound_and_empty_sub_pages_get_it(rng):
    keys = rng.standard_normal((1, PS, D)).astype(np.float32)
    kmin, kmax = page_min_max(keys.transpose(1, 0, 2), 5)
    codes = fine_bounds.page_sub_bounds(keys, 4, kmin, kmax, valid=5)  # sub-pages 2, 3 hold no token
    assert np.all(codes[:, 2:] == 0)
    lo, hi = fine_bounds.decode(codes, kmin, kmax)
    np.testing.assert_array_equal(lo[:, 2], kmin)
    np.testing.assert_array_equal(hi[:, 2], kmax)


def test_bounds_outside_the_page_refused(rng):
    keys = rng.standard_normal((1, PS, D)).astype(np.float32)
    kmin, kmax = page_min_max(keys.transpose(1, 0, 2))
    with pytest.raises(ValueError, match="outside"):
        fine_bounds.page_sub_bounds(keys, 4, kmin + 1, kmax)
    with pytest.raises(ValueError, match="divide"):
        fine_bounds.page_sub_bounds(keys, 3, kmin, kmax)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_metadata_within_an_eighth_of_the_kv_bytes(head_dim):
    """Issue #15's memory target at the package defaults (page 16, FP16) with 4-token sub-pages."""
    kv = fine_bounds.kv_bytes_per_token(head_dim)
    assert kv == 4 * head_dim
    assert fine_bounds.metadata_bytes_per_token(16, 0, head_dim) / kv == 1 / 16  # coarse only
    assert fine_bounds.metadata_bytes_per_token(16, 4, head_dim) / kv == 1 / 8  # + one byte per channel per 4 tokens
    assert fine_bounds.metadata_bytes_per_token(32, 4, head_dim) / kv == 3 / 32
