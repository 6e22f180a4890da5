"""The ``_int8`` overload: hot + INT8 cold pages in ORT equal the reference, and equal
the op on the dequantized all-hot cache."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tinyserve_trt.ops import schema, sparse_attention_ref
from tinyserve_dev.cases import CaseSpec, dequantized_float32_case, make_mixed_case
from tinyserve_trt.ops.node import make_node, make_op_model, node_attributes

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
    # the hot cache the op reads: int8 * scale in float32 (rounded to float16 it moves an output)
    hot_out, hot_sel = run_op(dequantized_float32_case(case), attrs, "float32")
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


def test_float16_equals_the_hot_cache_the_op_reads():
    """A float16 case (seed 3154635728, a CI flake): the cold path reads int8 * scale in float32,
    never rounded to float16, so the hot equivalent is the float32 dequantized cache - with it
    rounded to float16 the reference itself moved one output by 2.8e-3, past the tolerance."""
    spec = CaseSpec((0, 7, 40, 16), 8, 2, 16, 16, 5, "float16")
    _check(make_mixed_case(spec, np.random.default_rng(3154635728), 0.6), schema.OpAttributes(), "float16")


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


# ---- INT4 cold pages (issue #17): packed nibbles, float16 scales per channel group -----------------------------

def run_mixed4(case, attrs, dtype, opset=schema.OPSET):
    key = (attrs, dtype, "int4", opset)
    if key not in _SESSIONS:
        model = make_op_model(dtype, attrs, cold_pages=True, cold_format="int4", opset=opset)
        _SESSIONS[key] = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return _SESSIONS[key].run(None, {n: case[n] for n in schema.node_input_names(True, attrs.two_level) if n})


def _check4(case, attrs, dtype, opset=schema.OPSET):
    assert case["key_cache_int8"].dtype == np.uint8 and case["key_scale"].dtype == np.float16
    out, sel = run_mixed4(case, attrs, dtype, opset)
    ref, ref_sel = sparse_attention_ref(**case, attrs=attrs)
    tol = schema.TOLERANCES[dtype]
    np.testing.assert_allclose(out.astype(np.float64), ref.astype(np.float64), **tol)
    np.testing.assert_array_equal(sel.sum(-1), ref_sel.sum(-1))
    hot_out, hot_sel = run_op(dequantized_float32_case(case), attrs, "float32")
    np.testing.assert_allclose(out.astype(np.float64), hot_out.astype(np.float64), **tol)
    np.testing.assert_array_equal(sel.sum(-1), hot_sel.sum(-1))


@pytest.mark.parametrize("dtype", schema.FLOAT_TYPES)
@pytest.mark.parametrize("granularity,group", [(("channel", "token"), 8), (("channel", "token"), 0),
                                               (("channel", "head"), 4)])
def test_int4_decode_matches_reference(rng, dtype, granularity, group):
    lens = tuple(int(x) for x in rng.integers(1, 16 * 10, 3))
    for budget_pages in (2, 0):
        spec = CaseSpec(lens, 8, 2, 16, 16, 1, dtype, budget_pages * 16)
        case = make_mixed_case(spec, rng, float(rng.uniform(0.2, 0.8)), *granularity, cold_format="int4",
                               group_size=group)
        _check4(case, schema.OpAttributes(sink_pages=int(rng.integers(0, 2))), dtype)


@pytest.mark.parametrize("opset", [17, 18, 23])
def test_int4_body_for_every_opset(rng, opset):
    """Opset 17 unpacks with a lookup Gather, 18+ with BitwiseAnd/BitShift: both are the reference."""
    spec = CaseSpec((70, 33, 120), 6, 2, 16, 8, 1, "float32", 24)
    case = make_mixed_case(spec, rng, 0.5, cold_format="int4", group_size=8)
    _check4(case, schema.OpAttributes(), "float32", opset)
    model = make_op_model("float32", schema.OpAttributes(), cold_pages=True, cold_format="int4", opset=opset)
    onnx.checker.check_model(model, full_check=True)
    ops = {n.op_type for f in model.functions for n in _nodes(f.node)}
    assert ("BitwiseAnd" in ops) == (opset >= 18)


def _nodes(nodes):
    """Every node, those of If branches included."""
    for n in nodes:
        yield n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _nodes(a.g.node)


def test_int4_prefill_and_two_level(rng):
    # no cached page at all: every gather is empty (the first prefill of a batch)
    _check4(make_mixed_case(CaseSpec((0, 0), 4, 2, 16, 16, 5, "float32", spare_pages=4), rng, 0.5,
                            cold_format="int4", group_size=8), schema.OpAttributes(), "float32")
    _check4(make_mixed_case(CaseSpec((0, 7, 40, 16), 8, 2, 16, 16, 5, "float32"), rng, 0.6, cold_format="int4",
                            group_size=8), schema.OpAttributes(), "float32")
    spec = CaseSpec((70, 33, 120), 4, 2, 16, 16, 1, "float32", 32, sub_page_size=4)
    case = make_mixed_case(spec, rng, 0.5, cold_format="int4", group_size=4)
    _check4(case, schema.OpAttributes(sub_page_size=4), "float32")


@pytest.mark.parametrize("dtype", schema.FLOAT_TYPES)
@pytest.mark.parametrize("opset", [17, schema.OPSET])
def test_int4_two_level_keys_on_sub_page_bounds(rng, dtype, opset):
    """Format 3, two-level: cold keys dequantize on their sub-page's decoded bounds in every gather
    of the body - the sparse sub-page gather, the dense part and the every-page (If) branch,
    prefill - GQA, batch > 1, ragged and partial pages. The reference reads the same rule
    (and the all-hot run of the dequantized pools must agree)."""
    lens = tuple(int(x) for x in rng.integers(1, 16 * 9, 4))
    for S, budget in ((1, 32), (1, 0), (3, 32)):
        spec = CaseSpec(lens, 8, 2, 16, 16, S, dtype, budget, sub_page_size=4)
        case = make_mixed_case(spec, rng, float(rng.uniform(0.3, 0.7)), cold_format="int4", group_size=8)
        _check4(case, schema.OpAttributes(sub_page_size=4, sink_pages=int(rng.integers(0, 2))), dtype, opset)


def test_int4_two_level_reads_the_codes(rng):
    """The sub-page rule is observable: the same cold bytes read on the page bounds give another
    output, so a body (or reference) that ignored the codes would fail the checks above."""
    spec = CaseSpec((70, 33, 120), 4, 2, 16, 16, 1, "float32", 0, sub_page_size=4)
    case = make_mixed_case(spec, rng, 0.5, cold_format="int4", group_size=8)
    attrs = schema.OpAttributes(sub_page_size=4)
    out, _ = run_mixed4(case, attrs, "float32")
    P = case["key_cache"].shape[0]
    page_rule = dict(case, key_sub_bounds=case["key_sub_bounds"].copy())
    page_rule["key_sub_bounds"][P:] = 0  # code 0: the page bounds
    other, _ = run_mixed4(page_rule, attrs, "float32")
    assert np.abs(out - other).max() > 1e-3


def test_int4_overload_name():
    names = list(schema.node_input_names(cold_pages=True))
    node = make_node(names, ["o"], cold_pages=True, cold_format="int4")
    assert node.overload == "query_aware_int4"
    # the attribute the TensorRT plugin reads (its cold_format field) names the same format
    assert node_attributes(node).cold_format == "int4"
    assert node_attributes(make_node(names, ["o"], cold_pages=True)).cold_format == "int8"
    assert schema.OpAttributes(cold_format="int4").function_overload(True) == "query_aware_int4"
    with pytest.raises(ValueError, match="cold_format"):
        schema.OpAttributes(cold_format="int2")
    assert schema.overload_cold_format("query_aware_sum_int4") == "int4"
    assert schema.overload_cold_format("query_aware") is None
    with pytest.raises(ValueError, match="cold_format"):
        schema.OpAttributes().function_overload(True, "int2")
