"""Packed INT4 cold pages in the CUDA kernels against the numpy reference.

The INT4 twin of the mixed hot + INT8 tests in ``test_kernels_gpu.py`` and
``test_two_level_kernels.py``: the cold pools are uint8 ``[Pcold, Hkv, ps, D/2]``
(channel j in the low nibble of byte j, j + D/2 in the high one), format 3: V asymmetric
with float16 scales + mins per channel group, K on the page's key_min/key_max or, two-level,
on each sub-page's decoded codes (``ops/cold_codec.py``), and the kernels dequantize on load
(``qsa_common.cuh::cold_key`` / ``cold_v`` / ``ScaleView``). ``sparse_attention_ref``
dequantizes with the codec itself, so a swapped nibble order or a wrong scale
column moves the outputs far past the tolerance. Marked ``gpu``; without CUDA the
``cuda_lib`` fixture runs the same kernel sources in the CPU emulation.
"""

import ctypes

import numpy as np
import pytest

from tinyserve_dev.cases import CaseSpec, dequantized_float32_case, make_mixed_case
from tinyserve_dev.kernels.references import attention_with_selection_ref
from tinyserve_trt.cuda import library
from tinyserve_trt.ops import schema

from .test_kernels_gpu import LENS, _assert_close, _assert_mixed, _run_mixed_and_check
from .test_two_level_kernels import BUDGETS, run_two_level

pytestmark = pytest.mark.gpu

# (K granularity, V granularity, group_size): INT4 keys are per channel on the page bounds; V per
# token in whole-head and 16-channel groups, one scale per 32-channel group over the page, per channel.
INT4_GRANULARITIES = [("channel", "token", 0), ("channel", "token", 16), ("channel", "head", 32),
                      ("channel", "channel", 8)]


def _int4_case(spec, rng, granularity, cold_fraction=0.5):
    case = make_mixed_case(spec, rng, cold_fraction, granularity[0], granularity[1], cold_format="int4",
                           group_size=granularity[2])
    assert case["key_cache_int8"].dtype == np.uint8 and case["key_scale"].dtype == np.float16
    assert case["key_cache_int8"].shape[-1] * 2 == case["key_cache"].shape[-1]
    return case


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("granularity", INT4_GRANULARITIES)
def test_int4_decode_matches_reference(cuda_lib, rng, dtype, granularity):
    case = _int4_case(CaseSpec(LENS, 8, 2, 64, 16, 1, dtype, budget=64), rng, granularity,
                      float(rng.uniform(0.3, 0.7)))
    case["token_budget"] = np.array([64, 0, 32, 48, 96], dtype=np.int32)  # mixed, incl. dense (0)
    _run_mixed_and_check(case, schema.OpAttributes(), dtype)


@pytest.mark.parametrize("head_dim,group_size", [(80, 16), (128, 0), (20, 4)])  # lanes past D; 5 groups
@pytest.mark.parametrize("num_splits", [1, 3])
def test_int4_decode_head_dims_and_splits(cuda_lib, rng, head_dim, group_size, num_splits):
    dtype = "float16" if head_dim == 20 else "float32"  # fp16 rows that are not whole 16-byte vectors
    case = _int4_case(CaseSpec((37, 200, 130), 8, 2, head_dim, 16, 1, dtype, budget=80), rng,
                      ("channel", "token", group_size))
    _run_mixed_and_check(case, schema.OpAttributes(sink_pages=2, group_reduce="sum"), dtype, num_splits=num_splits)


def test_int4_equals_kernel_on_dequantized_cache(cuda_lib, rng):
    """float32: dequantizing INT4 on load gives what the hot path gives on the dequantized pools."""
    from tinyserve_dev.kernels.harness import sparse_attention_gpu

    case = _int4_case(CaseSpec((130, 300, 64), 8, 2, 64, 16, 1, "float32", budget=64), rng,
                      ("channel", "token", 16))
    _assert_mixed(case)
    out, sel = sparse_attention_gpu(**case)
    hot_out, hot_sel = sparse_attention_gpu(**dequantized_float32_case(case))
    np.testing.assert_array_equal(sel, hot_sel)
    _assert_close(out, hot_out, "float32", "int4 mixed vs all-hot kernel")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("granularity", INT4_GRANULARITIES[1:3])
def test_int4_prefill_matches_reference(cuda_lib, rng, dtype, granularity):
    case = _int4_case(CaseSpec(LENS, 8, 2, 64, 16, 4, dtype, budget=32), rng, granularity, 0.6)
    _run_mixed_and_check(case, schema.OpAttributes(), dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("granularity", [INT4_GRANULARITIES[1], INT4_GRANULARITIES[2]])
def test_int4_two_level_decode(cuda_lib, rng, dtype, granularity):
    """Two-level: sub-page bounds encode the dequantized INT4 keys; the decode dequantizes."""
    spec = CaseSpec(LENS, 8, 2, 64, 16, 1, dtype, sub_page_size=4)
    case = _int4_case(spec, rng, granularity)
    case["token_budget"] = np.asarray(BUDGETS["sparse"], dtype=np.int32)
    _assert_mixed(case)
    attrs = schema.OpAttributes(sub_page_size=4)
    got, _ = run_two_level(case, attrs, dtype, num_splits=3)
    from tinyserve_dev.kernels.harness import sparse_attention_gpu

    out, _ = sparse_attention_gpu(**case, attrs=attrs, num_splits=3)
    _assert_close(out, attention_with_selection_ref(dequantized_float32_case(case), got, attrs), dtype,
                  "two-level int4 output vs dequantized all-hot cache")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("S,budget", [(1, 0), (1, 48), (3, 32)], ids=["decode-dense", "decode-sparse", "prefill"])
def test_int4_two_level_reference_onnx_kernel_agree(cuda_lib, rng, dtype, S, budget):
    """Format 3, two-level: cold keys on their sub-page's decoded bounds in all three - the numpy
    reference, the ONNX function (ORT) and the emulated kernel (decode's kept sub-pages, prefill's
    every page) - on a randomized GQA batch with ragged lengths and partial last pages."""
    ort = pytest.importorskip("onnxruntime")
    from tinyserve_dev.kernels.harness import sparse_attention_gpu
    from tinyserve_trt.ops.node import make_op_model
    from tinyserve_trt.ops.reference import sparse_attention_ref

    lens = tuple(int(x) for x in rng.integers(1, 16 * 12, 4))
    case = _int4_case(CaseSpec(lens, 8, 2, 64, 16, S, dtype, budget=budget, sub_page_size=4), rng,
                      ("channel", "token", 16), float(rng.uniform(0.3, 0.7)))
    attrs = schema.OpAttributes(sub_page_size=4)
    ref, ref_sel = sparse_attention_ref(**case, attrs=attrs)
    sess = ort.InferenceSession(make_op_model(dtype, attrs, cold_pages=True, cold_format="int4").SerializeToString(),
                                providers=["CPUExecutionProvider"])
    onnx_out, onnx_sel = sess.run(None, {n: case[n] for n in schema.node_input_names(True, True) if n})
    _assert_close(onnx_out, ref, dtype, "two-level int4: ONNX function vs reference")
    if S == 1 and budget:  # sparse decode: the kept sub-pages may break near-ties another way
        run_two_level(case, attrs, dtype, num_splits=2)
        return
    out, sel = sparse_attention_gpu(**case, attrs=attrs, num_splits=2)
    np.testing.assert_array_equal(sel, ref_sel)
    np.testing.assert_array_equal(onnx_sel, ref_sel)
    _assert_close(out, ref, dtype, "two-level int4: emulated kernel vs reference")


def test_int4_single_cold_page(cuda_lib, rng):
    case = _int4_case(CaseSpec((40, 20), 4, 2, 16, 8, 1, "float32", 16, spare_pages=0), rng,
                      ("channel", "token", 4), 1.0)
    assert case["key_cache"].shape[0] == 1
    _run_mixed_and_check(case, schema.OpAttributes(), "float32")


def _check(lib, case, cold_format, **cold):
    """qsa_check on what the harness would pass for ``case``, with QsaColdDims fields overridden."""
    names = [*case, "output", "selected_pages"]
    p = library.forward_params({n: case[n].shape if n in case else None for n in names},
                               {n: 0x1000 + 0x100 * i for i, n in enumerate(names)}, "float32",
                               schema.OpAttributes(), cold_format=cold_format)
    for k, v in cold.items():
        setattr(p.cold, k, v)
    return lib.qsa_check(ctypes.byref(p))


def test_int4_params_checked(cuda_lib, rng):
    case = _int4_case(CaseSpec((40, 7), 4, 2, 48, 8, 1, "float32", 16), rng, ("channel", "token", 16))
    assert _check(cuda_lib, case, "int4") == library.QSA_OK
    assert _check(cuda_lib, case, "int4", value_scale_channels=16) == 1  # groups of 3 channels: not 2^k
    assert _check(cuda_lib, case, "int4", format=len(schema.COLD_FORMATS)) == 1  # unknown format
    with pytest.raises(ValueError, match="key_cache_int8"):  # int4 pools read as int8: half the channels
        _check(cuda_lib, case, "int8")
    with pytest.raises(ValueError, match="cold_format"):
        _check(cuda_lib, case, "int2")
