"""The ``_int8`` overload: hot + INT8 cold pages in ORT equal the reference, and equal
the op on the dequantized all-hot cache."""

import numpy as np
import onnxruntime as ort
import pytest

from tinyserve_trt.ops import schema, sparse_attention_ref
from tinyserve_dev.cases import CaseSpec, dequantized_case, make_mixed_case
from tinyserve_trt.ops.node import make_node, make_op_model

from .conftest import run_op

_SESSIONS = {}


def run_mixed(case, attrs, dtype):
    key = (attrs, dtype)
    if key not in _SESSIONS:
        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        model = make_op_model(dtype, attrs, cold_pages=True)
        _SESSIONS[key] = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return _SESSIONS[key].run(None, {n: case[n] for n in schema.node_input_names(True, attrs.two_level) if n})


def _check(case, attrs, dtype):
    out, sel = run_mixed(case, attrs, dtype)
    ref, ref_sel = sparse_attention_ref(**case, attrs=attrs)
    tol = schema.TOLERANCES[dtype]
    np.testing.assert_allclose(out.astype(np.float64), ref.astype(np.float64), **tol)
    np.testing.assert_array_equal(sel.sum(-1), ref_sel.sum(-1))
    hot = dequantized_case(case)
    hot_out, hot_sel = run_op(hot, attrs, dtype)
    np.testing.assert_allclose(out.astype(np.float64), hot_out.astype(np.float64), **tol)
    np.testing.assert_array_equal(sel.sum(-1), hot_sel.sum(-1))


@pytest.mark.parametrize("dtype", schema.FLOAT_TYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("granularity", [("channel", "token"), ("head", "head"), ("token", "channel")])
def test_mixed_decode_matches_reference(rng, dtype, heads, kv_heads, granularity):
    lens = tuple(int(x) for x in rng.integers(1, 16 * 10, 3))
    for budget_pages in (2, 0):
        spec = CaseSpec(lens, heads, kv_heads, 16, 16, 1, dtype, budget_pages * 16)
        case = make_mixed_case(spec, rng, float(rng.uniform(0.2, 0.8)), *granularity)
        _check(case, schema.OpAttributes(sink_pages=int(rng.integers(0, 2))), dtype)


@pytest.mark.parametrize("policy", schema.POLICIES)
@pytest.mark.parametrize("group_reduce", schema.GROUP_REDUCTIONS)
def test_every_policy_with_cold_pages(rng, policy, group_reduce):
    spec = CaseSpec((70, 33, 120), 6, 2, 16, 8, 1, "float32", 24)
    case = make_mixed_case(spec, rng, 0.5)
    _check(case, schema.OpAttributes(policy=policy, group_reduce=group_reduce), "float32")


@pytest.mark.parametrize("dtype", schema.FLOAT_TYPES)
def test_mixed_prefill(rng, dtype):
    spec = CaseSpec((0, 7, 40, 16), 8, 2, 16, 16, 5, dtype)
    _check(make_mixed_case(spec, rng, 0.6), schema.OpAttributes(), dtype)


def test_single_cold_and_single_hot_page(rng):
    for frac in (0.0, 1.0):  # clipped to one page in the smaller tier
        case = make_mixed_case(CaseSpec((40, 20), 4, 2, 16, 8, 1, "float32", 16, spare_pages=0), rng, frac)
        assert min(case["key_cache"].shape[0], case["key_cache_int8"].shape[0]) == 1
        _check(case, schema.OpAttributes(), "float32")


def test_cold_inputs_need_the_int8_overload():
    names = list(schema.node_input_names(cold_pages=True))
    assert make_node(names, ["o"], cold_pages=True).overload == "query_aware_int8"
    with pytest.raises(ValueError, match="cold_pages=True"):
        make_node(names, ["o"])
    with pytest.raises(ValueError, match="needs all"):
        make_node(names[:12], ["o"], cold_pages=True)
