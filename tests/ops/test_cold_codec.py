"""ColdCodec (ops/cold_codec.py): the pinned byte layout, INT4 packing and the error bounds (INT8's
shapes and calibrated scales: test_quantization.py; torch == numpy: test_cold_codec_torch.py)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tinyserve_trt.ops import quantization
from tinyserve_trt.ops.cold_codec import ColdCodec, expand_scale, pack_nibbles, page_bounds, unpack_nibbles
from tinyserve_trt.ops.fine_bounds import decode, level_step, page_sub_bounds

PAGES = hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([1, 4, 16]), st.sampled_from([2, 8, 16])),
                   elements=st.floats(-1e4, 1e4, width=32))


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.uint8, st.tuples(st.integers(1, 4), st.sampled_from([2, 6, 64])), elements=st.integers(0, 15)))
def test_pack_unpack_round_trip(q):
    packed = pack_nibbles(q)
    assert packed.dtype == np.uint8 and packed.shape == q.shape[:-1] + (q.shape[-1] // 2,)
    np.testing.assert_array_equal(unpack_nibbles(packed), q)
    np.testing.assert_array_equal(packed % 16, q[..., : q.shape[-1] // 2])  # channel j: low nibble of byte j
    np.testing.assert_array_equal(packed // 16, q[..., q.shape[-1] // 2:])  # channel j + D/2: its high nibble


def test_the_format_bytes_are_pinned():
    """The bytes the CPU node and the CUDA kernels decode (qsa_math.h), on pages whose scales are
    exact: a refactor of the one definition must not move a bit."""
    int8 = ColdCodec("int8", "channel", "channel")
    x = np.array([[[127.0, -254.0], [3.5, 5.0]]], np.float32)  # channel absmax 127, 254: scales 1, 2
    q, s = int8.quantize(x, "k")
    np.testing.assert_array_equal(s, [[[1.0, 2.0]]])
    np.testing.assert_array_equal(q, [[[127, -127], [4, 2]]])  # rint: halves to even
    int4 = ColdCodec("int4", "channel", "token", 0)
    v = np.array([[[0.0, 1.0, 2.0, 15.0], [-3.0, -3.0, -3.0, -3.0]]], np.float32)
    q, s = int4.quantize(v, "v")
    assert s.dtype == np.float16 and q.dtype == np.uint8
    np.testing.assert_array_equal(s, [[[1.0, 0.0], [1.0, -3.0]]])  # per token: scale, then min
    np.testing.assert_array_equal(q, [[[0x20, 0xF1], [0x00, 0x00]]])  # byte j: q[j] low, q[j + D/2] high
    np.testing.assert_array_equal(int4.dequantize(q, s), v)
    k = np.array([[[0.0, 10.0], [15.0, -5.0]]], np.float32)  # bounds [0, 15] and [-5, 10]: step 1
    kmin, kmax = page_bounds(k)
    q, s = int4.quantize(k, "k", bounds=(kmin, kmax))
    np.testing.assert_array_equal(q, [[[0xF0], [0x0F]]])  # q = k - key_min
    np.testing.assert_array_equal(s, np.ones((1, 1, 1), np.float16))
    np.testing.assert_array_equal(int4.dequantize_keys(q, s, kmin, kmax), k)


@settings(max_examples=300, deadline=None)
@given(PAGES, st.sampled_from(["channel", "token", "head"]), st.sampled_from([0, 2]),
       st.sampled_from([np.float32, np.float16]), st.data())
def test_int4_values_error_is_at_most_half_a_scale(x, granularity, group, dtype, data):
    """V (asymmetric): |x - deq(q(x))| <= scale / 2 (+ float32 rounding of q * scale + min)
    elementwise over the valid tokens, with the stored float16 scale; the stored min is at most
    the group's min, and the top level reaches its max. fp32 and fp16 pools."""
    x = x.astype(dtype)
    Hkv, ps, D = x.shape
    valid = data.draw(st.integers(1, ps))
    codec = ColdCodec("int4", "channel", granularity, group)
    q, scale = codec.quantize(x, "v", valid)
    assert q.dtype == np.uint8 and q.shape == (Hkv, ps, D // 2)
    assert scale.dtype == np.float16 and scale.shape == codec.scale_shape("v", Hkv, ps, D)
    C = scale.shape[-1] // 2
    step, vmin = (expand_scale(s, ps, D).astype(np.float64) for s in (scale[..., :C], scale[..., C:]))
    assert np.all(step > 0)
    deq = codec.dequantize(q, scale, np.float64)
    assert deq.dtype == np.float64
    err = np.abs(x.astype(np.float64) - deq)[:, :valid]
    top = vmin + 15 * step
    rounding = 2 * np.finfo(np.float32).eps * np.maximum(np.abs(vmin), np.abs(top))
    assert np.all(err <= (step / 2 + rounding)[:, :valid])
    # the min is rounded down exactly; the top level reaches the max up to the float rounding of
    # max - min (a denormal max above a large negative min may vanish in it: hypothesis found 1.4e-45)
    assert np.all(vmin[:, :valid] <= x[:, :valid]) and np.all((top + rounding)[:, :valid] >= x[:, :valid])


def _key_page(x, data):
    """A drawn valid-token count, the INT4 codec and the page bounds of keys ``x [Hkv, ps, D]``."""
    valid = data.draw(st.integers(1, x.shape[1]))
    kmin, kmax = page_bounds(x, valid)
    return valid, ColdCodec("int4", "channel", "token", 2), kmin, kmax


def _f32_rounding(lo, hi):
    """float32 rounding of a dequantized key between ``lo`` and ``hi``: relative, and absolute where
    the step is subnormal (it may even round to 0)."""
    return 4 * np.finfo(np.float32).eps * np.maximum(np.abs(lo), np.abs(hi)).astype(np.float64) \
        + 16 * float(np.finfo(np.float32).smallest_subnormal)


@settings(max_examples=300, deadline=None)
@given(PAGES, st.sampled_from([np.float32, np.float16]), st.data())
def test_int4_keys_on_the_page_bounds(x, dtype, data):
    """K: ``min(key_min + q * step, key_max)`` stays inside the page bounds (the selection metadata
    stays an upper bound) and |x - k'| <= step / 2 (+ float32 rounding) over the valid tokens;
    the extremes of each channel come back exactly."""
    x = x.astype(dtype)
    if not np.all(np.isfinite(x)):
        return
    Hkv, ps, D = x.shape
    valid, codec, kmin, kmax = _key_page(x, data)
    q, scale = codec.quantize(x, "k", valid, bounds=(kmin, kmax))
    assert q.dtype == np.uint8 and q.shape == (Hkv, ps, D // 2) and scale.shape == (Hkv, 1, 1)
    deq = codec.dequantize_keys(q, scale, kmin, kmax)
    assert deq.dtype == np.float32
    lo, hi = kmin.astype(np.float32)[:, None, :], kmax.astype(np.float32)[:, None, :]
    assert np.all(deq >= lo) and np.all(deq <= hi)
    step = level_step(kmin, kmax)[:, None, :].astype(np.float64)
    rounding = _f32_rounding(lo, hi)
    err = np.abs(x.astype(np.float64) - deq)[:, :valid]
    assert np.all(err <= step / 2 + rounding)
    np.testing.assert_array_equal(deq[:, :valid].min(axis=1), lo[:, 0])  # q = 0 is key_min exactly
    assert np.all(unpack_nibbles(q) <= 15)


SUB_PAGES = hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([4, 16]), st.sampled_from([2, 8])),
                       elements=st.floats(-1e4, 1e4, width=32))


@settings(max_examples=300, deadline=None)
@given(SUB_PAGES, st.sampled_from([np.float32, np.float16]), st.sampled_from([1, 2, 4]), st.data())
def test_int4_keys_on_the_sub_page_bounds(x, dtype, sp, data):
    """Two-level: each key quantizes between its sub-page's decoded fine bounds ``lo/hi`` (the codes
    computed from the hot keys), so ``lo <= k' <= hi`` - the codes and page bounds stay upper bounds
    of the dequantized keys, no metadata changes - and |x - k'| <= step_sub / 2 (+ float32 rounding)."""
    x = x.astype(dtype)
    if not np.all(np.isfinite(x)):
        return
    Hkv, ps, D = x.shape
    valid, codec, kmin, kmax = _key_page(x, data)
    codes = page_sub_bounds(x, sp, kmin, kmax, valid)  # [Hkv, r, D], from the hot keys
    q, scale = codec.quantize(x, "k", valid, bounds=(kmin, kmax), sub_codes=codes)
    deq = codec.dequantize_keys(q, scale, kmin, kmax, sub_codes=codes)
    assert deq.dtype == np.float32 and deq.shape == x.shape
    lo, hi = (np.repeat(b, sp, axis=1) for b in decode(codes, kmin, kmax))  # per token [Hkv, ps, D]
    assert np.all(deq >= lo) and np.all(deq <= hi)
    assert np.all(deq >= kmin.astype(np.float32)[:, None]) and np.all(deq <= kmax.astype(np.float32)[:, None])
    step = level_step(lo, hi).astype(np.float64)
    rounding = _f32_rounding(lo, hi)
    err = np.abs(x.astype(np.float64) - deq)[:, :valid]
    assert np.all(err <= (step / 2 + rounding)[:, :valid])
    # the codes of the dequantized keys are never wider than the stored ones: re-encoding them is
    # what a cold page's metadata could be, and the stored codes still hold them
    np.testing.assert_array_equal(deq[:, :valid].min(axis=1), kmin.astype(np.float32))  # lo_c 0 at the min
    # no codes = the page bounds (single-level packages keep format 2's rule)
    np.testing.assert_array_equal(codec.dequantize_keys(q, scale, kmin, kmax, sub_codes=np.zeros_like(codes)),
                                  codec.dequantize_keys(q, scale, kmin, kmax))


def test_int4_keys_beat_symmetric_absmax_on_offset_channels():
    """The point of the bounds rule: a channel offset from 0 (keys often are) gets 15 steps over
    its range instead of 7 over its absmax."""
    rng = np.random.default_rng(0)
    x = (5.0 + rng.uniform(-0.5, 0.5, (2, 32, 8))).astype(np.float32)
    codec = ColdCodec("int4", "channel", "token")
    kmin, kmax = page_bounds(x)
    err = np.abs(codec.dequantize_keys(*codec.quantize(x, "k"), kmin, kmax) - x).max()
    sym = 5.5 / 7 / 2  # half a symmetric absmax step
    assert err <= (kmax - kmin).max() / 15 / 2 + 1e-6 < sym / 10


def test_int4_keys_take_the_channel_rule_only():
    with pytest.raises(ValueError, match="k_granularity must be 'channel'"):
        ColdCodec("int4", "token", "token")
    with pytest.raises(ValueError, match="no scale"):
        ColdCodec("int4").quantize(np.zeros((1, 4, 2), np.float32), "k", scale=np.ones((1, 1, 1)))


# Tiny and subnormal float32 pages: absmax / qmax underflows to 0 or a denormal unless clamped.
TINY_PAGES = hnp.arrays(
    np.float32, st.tuples(st.integers(1, 3), st.sampled_from([1, 4, 16]), st.sampled_from([2, 8])),
    elements=st.one_of(st.just(0.0), st.floats(-2.0 ** -123, 2.0 ** -123, width=32, allow_subnormal=True),
                       st.sampled_from([float(np.float32(v))
                                        for v in (1e-44, -1e-44, 1.4e-45, 3e-39, np.finfo(np.float32).tiny)])))


def _assert_tiny_round_trip(x, q, scale, deq, scale_dtype, valid):
    info = np.finfo(scale_dtype)
    assert scale.dtype == scale_dtype and np.all(np.isfinite(scale))
    assert np.all(scale >= info.tiny), "a scale is 0 or denormal"
    assert np.all(np.isfinite(deq))
    bound = expand_scale(scale, x.shape[1], x.shape[2]).astype(np.float64) / 2
    err = np.abs(x.astype(np.float64) - deq.astype(np.float64))
    assert np.all(err[:, :valid] <= bound[:, :valid])


@settings(max_examples=300, deadline=None)
@given(TINY_PAGES, st.sampled_from(["channel", "token", "head"]), st.data())
def test_int8_tiny_values_keep_a_normal_scale_and_the_bound(x, granularity, data):
    valid = data.draw(st.integers(1, x.shape[1]))
    codec = ColdCodec("int8", granularity, granularity)
    q, scale = codec.quantize(x, "k", valid)
    _assert_tiny_round_trip(x, q, scale, codec.dequantize(q, scale), np.float32, valid)
    q, scale = codec.quantize(x[None], "k")  # the batched (full page) path
    _assert_tiny_round_trip(x, q[0], scale[0], codec.dequantize(q[0], scale[0]), np.float32, x.shape[1])


@settings(max_examples=300, deadline=None)
@given(TINY_PAGES, st.sampled_from(["channel", "token", "head"]), st.sampled_from([0, 2]), st.data())
def test_int4_tiny_values_keep_a_normal_scale_and_the_bound(x, granularity, group, data):
    valid = data.draw(st.integers(1, x.shape[1]))
    codec = ColdCodec("int4", "channel", granularity, group)
    q, scale = codec.quantize(x, "v", valid)
    C = scale.shape[-1] // 2  # the scales; the mins follow (and are 0 or tiny here)
    _assert_tiny_round_trip(x, q, scale[..., :C], codec.dequantize(q, scale), np.float16, valid)


def test_tiny_absmax_scale_is_clamped_not_zero():
    x = np.zeros((1, 1, 2), np.float32)
    x[0, 0, 0] = 1e-44  # / 127 is below float32's smallest denormal: the unclamped scale is 0
    q, scale = ColdCodec("int8", "head", "head").quantize(x, "k")
    assert scale.item() == np.finfo(np.float32).tiny and q[0, 0, 0] == 0
    assert quantization.group_scale(np.array([0.0, 1e-44, 1e300]), 127).tolist() == [
        1.0, float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)]


def test_bytes_and_shapes():
    int4 = ColdCodec("int4", "channel", "token", 32)
    # SmolLM2 page: K 16x64 nibbles (+ one unused fp16 placeholder: keys read the page bounds);
    # V + 16 tokens x 2 groups x (scale, min)
    assert int4.bytes_per_page("k", 1, 16, 64) == 512 + 2
    assert int4.bytes_per_page("v", 1, 16, 64) == 512 + 128
    assert ColdCodec().bytes_per_page("k", 3, 16, 64) == 3 * 16 * 64 + 4 * 3 * 64  # int8 + a float32 per channel
    with pytest.raises(ValueError, match="int4 cold pages only"):
        ColdCodec("int8", group_size=32)
    with pytest.raises(ValueError, match="cold_format"):
        ColdCodec("int2")
    with pytest.raises(ValueError, match="divide"):
        ColdCodec("int4", group_size=32).scale_shape("v", 1, 16, 48)
    with pytest.raises(ValueError, match="power of two"):
        ColdCodec("int4", group_size=3)


@pytest.mark.parametrize("fmt,group", [("int8", 0), ("int4", 16), ("int4", 0)])
def test_blank_cold_page_reads_as_zero_values(fmt, group):
    """An unused cold slot (zero bytes, the codec's blank scales) dequantizes to 0 values."""
    codec = ColdCodec(fmt, "channel", "token", group)
    q = np.zeros(codec.pool_shape(2, 4, 32), codec.storage_dtype)
    np.testing.assert_array_equal(codec.dequantize(q, codec.blank_scales("v", 2, 4, 32)), 0.0)
