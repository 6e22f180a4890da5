"""The ONNX function in ONNX Runtime equals the numpy reference."""

import numpy as np
import onnx
import pytest

from tinyserve_trt.ops import schema, sparse_attention_ref
from tinyserve_dev.cases import CaseSpec, make_case
from tinyserve_trt.ops.node import make_op_model
from tinyserve_trt.ops.policies import get_policy, reduce_group

from .conftest import run_op


def _lens(rng, batch, ps, max_pages):
    return tuple(int(x) for x in rng.integers(1, ps * max_pages, batch))


@pytest.mark.parametrize("dtype", schema.FLOAT_TYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 2), (8, 1)])  # GQA ratios 1/3/4/8
@pytest.mark.parametrize("page_size", [8, 16, 32])
def test_decode_matches_reference(rng, dtype, heads, kv_heads, page_size):
    batch = int(rng.integers(1, 5))
    lens = _lens(rng, batch, page_size, 12)
    for budget_pages in (1, 2, 5, 0):  # 0 = dense
        spec = CaseSpec(lens, heads, kv_heads, 16, page_size, 1, dtype, budget_pages * page_size)
        case = make_case(spec, rng)
        attrs = schema.OpAttributes(sink_pages=int(rng.integers(0, 2)))
        out, sel = run_op(case, attrs, dtype)
        ref_out, ref_sel = sparse_attention_ref(**case, attrs=attrs)
        tol = schema.TOLERANCES[dtype]
        np.testing.assert_allclose(out.astype(np.float64), ref_out.astype(np.float64), **tol)
        assert sel.shape == ref_sel.shape and sel.dtype == bool
        np.testing.assert_array_equal(sel.sum(-1), ref_sel.sum(-1))


@pytest.mark.parametrize("policy", schema.POLICIES)
@pytest.mark.parametrize("group_reduce", schema.GROUP_REDUCTIONS)
def test_every_policy_matches_reference(rng, policy, group_reduce):
    spec = CaseSpec(_lens(rng, 3, 8, 10), 6, 2, 16, 8, 1, "float32", 24)
    case = make_case(spec, rng)
    attrs = schema.OpAttributes(policy=policy, group_reduce=group_reduce, sink_pages=1, recent_pages=1)
    out, sel = run_op(case, attrs, "float32")
    ref_out, ref_sel = sparse_attention_ref(**case, attrs=attrs)
    np.testing.assert_allclose(out, ref_out, **schema.TOLERANCES["float32"])
    np.testing.assert_array_equal(sel.sum(-1), ref_sel.sum(-1))


@pytest.mark.parametrize("dtype", schema.FLOAT_TYPES)
@pytest.mark.parametrize("new_tokens", [2, 5, 16])
def test_prefill_is_exact_causal_attention(rng, dtype, new_tokens):
    lens = (0, 7, 40, 16)  # includes a sequence with an empty cache
    spec = CaseSpec(lens, 8, 2, 16, 16, new_tokens, dtype, budget=16)  # budget ignored when S > 1
    case = make_case(spec, rng)
    attrs = schema.OpAttributes()
    out, sel = run_op(case, attrs, dtype)
    ref_out, ref_sel = sparse_attention_ref(**case, attrs=attrs)
    np.testing.assert_allclose(out.astype(np.float64), ref_out.astype(np.float64), **schema.TOLERANCES[dtype])
    np.testing.assert_array_equal(sel, ref_sel)
    pages = [-(-n // 16) for n in lens]
    assert [int(x) for x in sel[:, 0].sum(-1)] == pages  # prefill attends every valid page


def test_selection_keeps_the_same_scores(rng):
    """Indices may differ on ties; the multiset of kept page scores may not."""
    spec = CaseSpec((300, 517), 8, 2, 32, 16, 1, "float32", 96)
    case = make_case(spec, rng)
    # force exact ties: duplicate a few pages' metadata
    pt = case["page_table"]
    case["key_min"][pt[0, 5]] = case["key_min"][pt[0, 6]]
    case["key_max"][pt[0, 5]] = case["key_max"][pt[0, 6]]
    attrs = schema.OpAttributes()
    _, sel = run_op(case, attrs, "float32")
    _, ref_sel = sparse_attention_ref(**case, attrs=attrs)
    policy = get_policy("query_aware")
    for b in range(2):
        n = -(-int(case["past_lens"][b]) // 16)
        ids = pt[b, :n]
        for h in range(2):
            q = case["query"][b, h * 4:(h + 1) * 4, 0].astype(np.float64)
            s = reduce_group(policy.score_ref(q, case["key_min"][ids, h], case["key_max"][ids, h], None, None,
                                              16, 1.0), "max")
            np.testing.assert_allclose(np.sort(s[sel[b, h, :n]]), np.sort(s[ref_sel[b, h, :n]]), rtol=1e-6)
            assert sel[b, h, :n].sum() == 6  # 96 tokens / 16
            assert not sel[b, h, n:].any()


def test_emitted_model_passes_full_check():
    for policy in schema.POLICIES:
        onnx.checker.check_model(make_op_model("float16", schema.OpAttributes(policy=policy)), full_check=True)


@pytest.mark.parametrize("opset", [17, 18, 20, 23])
def test_function_body_for_the_model_opset(rng, opset):
    """A function must import its model's ai.onnx version; exports come at 17-23."""
    model = make_op_model("float32", schema.OpAttributes())
    model.opset_import[0].version = opset
    del model.functions[:]
    from tinyserve_trt.ops.node import attach_functions
    attach_functions(model)
    onnx.checker.check_model(model, full_check=True)
    import onnxruntime as ort
    case = make_case(CaseSpec((70, 33), 4, 2, 16, 16, 1, "float32", 32), rng)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out, _ = sess.run(None, {n: case[n] for n in schema.INPUT_NAMES[:10]})
    np.testing.assert_allclose(out, sparse_attention_ref(**case)[0], **schema.TOLERANCES["float32"])


@pytest.mark.parametrize("sub_page_size", [0, 4])
def test_dense_steps_skip_the_selection(sub_page_size):
    """A step where every row keeps all its pages runs a branch with no scoring or TopK; a
    dense layer's body has no selection at all."""
    def ops(graph_nodes):
        return [n.op_type for n in graph_nodes]

    def deep_ops(graph_nodes):  # with those of nested subgraphs (a TopK's sorted/unsorted If)
        return [t for n in graph_nodes for t in [n.op_type, *(
            o for a in n.attribute if a.type == onnx.AttributeProto.GRAPH for o in deep_ops(a.g.node))]]

    attrs = schema.OpAttributes(sub_page_size=sub_page_size)
    body = make_op_model("float32", attrs).functions[0].node
    (branch,) = [n for n in body if n.op_type == "If"]
    graphs = {a.name: a.g for a in branch.attribute}
    assert "TopK" not in deep_ops(graphs["then_branch"].node) and "TopK" in deep_ops(graphs["else_branch"].node)
    assert "TopK" not in ops(body)  # the selection lives in its branch only
    dense = make_op_model("float32", schema.OpAttributes(policy="dense")).functions[0].node
    assert not {"If", "TopK"} & set(ops(dense))


@pytest.mark.parametrize("new_tokens", [1, 5])
def test_dense_step_reads_only_pages_that_hold_cached_tokens(rng, new_tokens):
    """A dense step gathers the table's first ceil(past / page_size) columns only: the columns
    after them (the pages this step writes, padding) hold no cached token. Poisoned with NaN,
    they must not reach the output - the old body gathered every column and masked them
    afterwards (NaN + -inf is NaN), half the attention work of a first prefill chunk."""
    spec = CaseSpec((40,), 8, 2, 16, 16, new_tokens, "float32", budget=0)
    case = make_case(spec, rng)
    ref_out, _ = sparse_attention_ref(**case, attrs=schema.OpAttributes())
    poisoned = dict(case)
    for name in ("key_cache", "value_cache", "key_min", "key_max"):
        pool = case[name]
        poisoned[name] = np.concatenate([pool, np.full((1,) + pool.shape[1:], np.nan, pool.dtype)])
    table = np.concatenate([case["page_table"][:, :3], np.full((1, 2), len(case["key_cache"]), np.int32)], 1)
    poisoned["page_table"] = table  # 40 tokens: pages 0-2 cached, columns 3-4 the poisoned page
    out, sel = run_op(poisoned, schema.OpAttributes(), "float32")
    np.testing.assert_allclose(out, ref_out, **schema.TOLERANCES["float32"])
    assert [int(x) for x in sel[0, 0]] == [1, 1, 1, 0, 0]
