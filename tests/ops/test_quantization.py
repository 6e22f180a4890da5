"""INT8 cold pages (``ColdCodec("int8", g, g)``) and the scale rules of ops/quantization.py:
shapes, the round-trip error bound, partial pages, calibrated scales."""

import numpy as np
import pytest

from tinyserve_trt.ops.cold_codec import ColdCodec
from tinyserve_trt.ops.quantization import GRANULARITIES, scale_shape, static_page_scale


def _int8(granularity):
    return ColdCodec("int8", granularity, granularity)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_round_trip_within_half_a_step(rng, granularity, dtype):
    x = (rng.standard_normal((3, 16, 32)) * (1 + 9 * (rng.random(32) < 0.1))).astype(dtype)
    q, scale = _int8(granularity).quantize(x, "k")
    assert q.dtype == np.int8 and q.shape == x.shape
    assert scale.dtype == np.float32 and scale.shape == scale_shape(granularity, 3, 16, 32)
    err = np.abs(x.astype(np.float64) - _int8(granularity).dequantize(q, scale, np.float64))
    bound = np.broadcast_to(scale.astype(np.float64) / 2, x.shape)
    # dequantization multiplies in float32 (as the op does): allow its rounding, 2^-24 relative
    assert np.all(err <= bound * (1 + 1e-6) + np.abs(x.astype(np.float64)) * 2.0 ** -23 + 1e-12)
    assert np.abs(q).max() <= 127


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_batched_equals_per_page(rng, granularity):
    x = rng.standard_normal((5, 2, 8, 16)).astype(np.float32)
    q, s = _int8(granularity).quantize(x, "v")
    for i in range(5):
        qi, si = _int8(granularity).quantize(x[i], "v")
        np.testing.assert_array_equal(q[i], qi)
        np.testing.assert_array_equal(s[i], si)


def test_partial_page_scales_ignore_the_garbage_tail(rng):
    x = rng.standard_normal((2, 8, 4)).astype(np.float32)
    x[:, 5:] = 1e6  # garbage past the valid tokens
    q, scale = _int8("channel").quantize(x, "k", valid=5)
    assert scale.max() < 1.0  # not widened by the tail
    err = np.abs(x[:, :5] - _int8("channel").dequantize(q, scale)[:, :5])
    assert np.all(err <= np.broadcast_to(scale, x.shape)[:, :5] / 2 * (1 + 1e-6))


def test_zero_page_and_bad_input():
    q, scale = _int8("head").quantize(np.zeros((1, 4, 4), np.float32), "k")
    assert np.all(q == 0) and np.all(scale == 1)
    with pytest.raises(ValueError, match="granularity"):
        ColdCodec("int8", "group", "group")
    with pytest.raises(ValueError, match="granularity"):
        scale_shape("group", 1, 4, 4)
    with pytest.raises(ValueError, match="Hkv, ps, D"):
        _int8("head").quantize(np.zeros((4, 4)), "k")
    with pytest.raises(ValueError, match="valid"):
        _int8("head").quantize(np.zeros((1, 4, 4)), "k", valid=5)


def test_bytes_per_page():
    assert _int8("head").bytes_per_page("k", 3, 16, 64) == 3 * 16 * 64 + 4 * 3
    assert _int8("channel").bytes_per_page("k", 3, 16, 64) == 3 * 16 * 64 + 4 * 3 * 64
    assert _int8("token").bytes_per_page("k", 3, 16, 64) == 3 * 16 * 64 + 4 * 3 * 16


def test_scale_shape_groups_channels():
    assert scale_shape("token", 2, 16, 64) == (2, 16, 1)
    assert scale_shape("token", 2, 16, 64, group_size=16) == (2, 16, 4)
    assert scale_shape("head", 2, 16, 64, group_size=32) == (2, 1, 2)
    assert scale_shape("channel", 2, 16, 64, group_size=32) == (2, 1, 64)  # a channel is its own group
    with pytest.raises(ValueError, match="divide"):
        scale_shape("token", 1, 16, 48, group_size=32)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_static_scale_covers_the_calibrated_range_and_clips_beyond(rng, granularity):
    hkv, ps, d = 2, 4, 8
    codec = _int8(granularity)
    absmax = rng.uniform(0.5, 4.0, (hkv, 1, d)).astype(np.float32)  # calibrated per (head, channel)
    scale = static_page_scale(absmax / 127, granularity, ps)
    assert scale.shape == scale_shape(granularity, hkv, ps, d)
    # a wider scale never clips more: it is >= the calibrated scale of every element it covers
    assert np.all(np.broadcast_to(scale, (hkv, ps, d)) >= np.broadcast_to(absmax / 127, (hkv, ps, d)) - 1e-9)
    inside = (rng.uniform(-1, 1, (hkv, ps, d)) * absmax).astype(np.float32)
    q, s = codec.quantize(inside, "k", scale=scale)
    np.testing.assert_array_equal(s, scale)
    assert np.all(np.abs(codec.dequantize(q, s) - inside) <= np.broadcast_to(s, inside.shape) / 2 + 1e-6)
    outside = inside.copy()
    outside[0, 0, 0] = 10 * np.broadcast_to(scale, inside.shape)[0, 0, 0] * 127
    q, _ = codec.quantize(outside, "k", scale=scale)
    assert q[0, 0, 0] == 127  # clipped at the calibrated range
    q, s = codec.quantize(np.stack([inside, outside]), "k", scale=scale)  # one page's scale, every page
    assert s.shape == (2, *scale.shape) and q[1, 0, 0, 0] == 127
    with pytest.raises(ValueError, match="static scale"):
        static_page_scale(np.ones((2, 3, 8), np.float32), granularity, ps)
