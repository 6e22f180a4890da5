"""The cold codec on torch tensors is the numpy codec, bit for bit (ops/array_ns.py runs the same
lines on both): random pages of odd shapes, INT8 and INT4, fp16 and fp32, partial pages, static
scales and sub-page codes. A GPU's pools (``runtime/backends/device_pages.py``) run this path on
CUDA tensors: the ``cuda`` cases (marked ``gpu``)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyserve_trt.ops.cold_codec import ColdCodec, pack_nibbles, page_bounds, unpack_nibbles
from tinyserve_trt.ops.fine_bounds import decode, pages_sub_bounds
from tinyserve_trt.ops.quantization import GRANULARITIES

torch = pytest.importorskip("torch")

CODECS = [("int8", g, g, 0) for g in GRANULARITIES] + [
    ("int4", "channel", v, gs) for v in GRANULARITIES for gs in (0, 2)]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    return torch.device(request.param)


def _same(got, want):
    """``got`` (a tensor) holds ``want``'s bytes, dtype and shape."""
    got = got.cpu().numpy()
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(want).view(np.uint8))


@st.composite
def pages(draw):
    """``x [N, Hkv, ps, D]`` of odd shapes, magnitudes from 1e-8 to 3e3 per channel (finite in
    float16), offsets, zeros."""
    n, h = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    ps, d = draw(st.sampled_from([1, 3, 4, 6])), draw(st.sampled_from([2, 6, 8]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    mag = 10.0 ** rng.uniform(-8, 3.5, (n, h, 1, d))
    x = rng.standard_normal((n, h, ps, d)) * mag + draw(st.sampled_from([0.0, 3.0])) * mag
    if draw(st.booleans()):
        x[0, 0] = 0.0  # an all-zero group
    return x.astype(draw(st.sampled_from([np.float32, np.float16])))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(x=pages(), codec=st.sampled_from(CODECS), partial=st.booleans(), data=st.data())
def test_torch_quantize_and_dequantize_are_the_numpy_codec(x, codec, partial, data, device):
    codec = ColdCodec(*codec)
    ps = x.shape[2]
    valid = data.draw(st.integers(1, ps)) if partial else None
    kmin, kmax = page_bounds(x, valid)
    xt = torch.from_numpy(x).to(device)
    for which in "kv":
        q, s = codec.quantize(x, which, valid)
        qt, st_ = codec.quantize(xt, which, valid)
        _same(qt, q)
        _same(st_, s)
        for dtype, tdtype in ((np.float32, torch.float32), (np.float16, torch.float16)):
            if which == "k":
                want = codec.dequantize_keys(q, s, kmin, kmax, dtype)
                got = codec.dequantize_keys(qt, st_, *(torch.from_numpy(b).to(device) for b in (kmin, kmax)), tdtype)
            else:
                want, got = codec.dequantize(q, s, dtype), codec.dequantize(qt, st_, tdtype)
            _same(got, want)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(x=pages(), sp=st.sampled_from([1, 2, 3]), data=st.data())
def test_torch_int4_keys_on_sub_page_codes_are_the_numpy_codec(x, sp, data, device):
    n, _, ps, _ = x.shape
    if ps % sp or not np.all(np.isfinite(x)):
        return
    codec = ColdCodec("int4", "channel", "token", 2)
    kmin, kmax = page_bounds(x)
    codes = pages_sub_bounds(x, sp, kmin, kmax, np.full(n, ps))
    t = [torch.from_numpy(a).to(device) for a in (x, kmin, kmax, codes)]
    for got, want in zip(decode(t[3], t[1], t[2]), decode(codes, kmin, kmax)):
        _same(got, want)
    q, s = codec.quantize(x, "k", bounds=(kmin, kmax), sub_codes=codes)
    qt, st_ = codec.quantize(t[0], "k", bounds=(t[1], t[2]), sub_codes=t[3])
    _same(qt, q)
    _same(st_, s)
    _same(codec.dequantize_keys(qt, st_, t[1], t[2], torch.float32, t[3]),
          codec.dequantize_keys(q, s, kmin, kmax, np.float32, codes))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_torch_static_scales_are_the_numpy_codec(granularity, device):
    rng = np.random.default_rng(0)
    codec = ColdCodec("int8", granularity, granularity)
    x = (rng.standard_normal((4, 3, 5, 6)) * 4).astype(np.float16)
    static = np.full(codec.scale_shape("k", 3, 5, 6), 3.0 / 127, np.float32)  # values past 3 clip
    q, s = codec.quantize(x, "k", scale=static)
    qt, st_ = codec.quantize(torch.from_numpy(x).to(device), "k", scale=torch.from_numpy(static).to(device))
    assert np.abs(q).max() == 127
    _same(qt, q)
    _same(st_, s)


def test_torch_nibbles_and_the_float16_rounding_edges(device):
    """Nibble packing, and the INT4 value scale rounding at float16's edges (the min rounds down
    through -0 and the denormals, the scale rounds up) where torch has no float16 nextafter."""
    q = np.arange(32, dtype=np.uint8).reshape(2, 16) % 16
    _same(pack_nibbles(torch.from_numpy(q).to(device)), pack_nibbles(q))
    _same(unpack_nibbles(torch.from_numpy(pack_nibbles(q)).to(device)), q)
    codec = ColdCodec("int4", "channel", "token", 2)
    edges = np.array([-1e-10, 1e-10, 5e-8, -5e-8, 6.1e-5, -6.1e-5, 65000.0, -65000.0, 1 / 3, -1 / 3, 0.0, 7.0],
                     np.float32).reshape(1, 1, 3, 4)
    q, s = codec.quantize(edges, "v")
    qt, st_ = codec.quantize(torch.from_numpy(edges).to(device), "v")
    _same(qt, q)
    _same(st_, s)
