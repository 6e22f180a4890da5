"""ColdCodec (ops/cold_codec.py): INT4 packing and the error bound; INT8 through it is ops.quantization."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tinyserve_trt.ops import quantization
from tinyserve_trt.ops.cold_codec import ColdCodec, expand_scale, pack_int4, unpack_int4

PAGES = hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([1, 4, 16]), st.sampled_from([2, 8, 16])),
                   elements=st.floats(-1e4, 1e4, width=32))


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.int8, st.tuples(st.integers(1, 4), st.sampled_from([2, 6, 64])), elements=st.integers(-8, 7)))
def test_pack_unpack_round_trip(q):
    packed = pack_int4(q)
    assert packed.dtype == np.uint8 and packed.shape == q.shape[:-1] + (q.shape[-1] // 2,)
    np.testing.assert_array_equal(unpack_int4(packed), q)
    np.testing.assert_array_equal(packed & 15, q[..., : q.shape[-1] // 2] + 8)  # channel j: low nibble of byte j


@settings(max_examples=300, deadline=None)
@given(PAGES, st.sampled_from(["channel", "token", "head"]), st.sampled_from([0, 2]), st.data())
def test_int4_error_is_at_most_half_a_scale(x, granularity, group, data):
    """|x - deq(q(x))| <= scale / 2 elementwise over the valid tokens, with the stored float16 scale."""
    Hkv, ps, D = x.shape
    valid = data.draw(st.integers(1, ps))
    codec = ColdCodec("int4", granularity, granularity, group)
    q, scale = codec.quantize(x, "k", valid)
    assert q.dtype == np.uint8 and q.shape == (Hkv, ps, D // 2)
    assert scale.dtype == np.float16 and scale.shape == codec.scale_shape("k", Hkv, ps, D)
    err = np.abs(x.astype(np.float64) - codec.dequantize(q, scale, np.float64))[:, :valid]
    bound = expand_scale(scale, ps, D)[:, :valid].astype(np.float64) / 2
    assert np.all(err <= bound * (1 + 1e-6) + 1e-30)
    assert np.all(np.abs(unpack_int4(q)) <= 7)


@settings(max_examples=100, deadline=None)
@given(PAGES, st.sampled_from(["channel", "token", "head"]))
def test_int8_codec_is_the_int8_quantizer(x, granularity):
    # the INT8 float32 scale absmax/127 underflows to 0 for |x| < ~1e-36 (INT4 clamps its float16 scale)
    x = np.where(np.abs(x) < 1e-30, 0, x).astype(np.float32)
    codec = ColdCodec("int8", granularity, granularity)
    q, s = codec.quantize(x, "v", x.shape[1] - 1 if x.shape[1] > 1 else None)
    q2, s2 = quantization.quantize_page(x, granularity, x.shape[1] - 1 if x.shape[1] > 1 else None)
    np.testing.assert_array_equal(q, q2)
    np.testing.assert_array_equal(s, s2)
    np.testing.assert_array_equal(codec.dequantize(q, s), quantization.dequantize_page(q2, s2))


def test_bytes_and_shapes():
    int4 = ColdCodec("int4", "channel", "token", 32)
    # SmolLM2 page: K 16x64 nibbles + 64 fp16 channel scales; V + 16 tokens x 2 groups
    assert int4.bytes_per_page("k", 1, 16, 64) == 512 + 128
    assert int4.bytes_per_page("v", 1, 16, 64) == 512 + 64
    assert ColdCodec().bytes_per_page("k", 3, 16, 64) == quantization.bytes_per_page("channel", 3, 16, 64)
    with pytest.raises(ValueError, match="int4 cold pages only"):
        ColdCodec("int8", group_size=32)
    with pytest.raises(ValueError, match="cold_format"):
        ColdCodec("int2")
    with pytest.raises(ValueError, match="divide"):
        ColdCodec("int4", group_size=32).scale_shape("v", 1, 16, 48)
    with pytest.raises(ValueError, match="power of two"):
        ColdCodec("int4", group_size=3)
