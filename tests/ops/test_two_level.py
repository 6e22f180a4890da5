"""Two-level selection: the ONNX function in ORT equals the numpy reference, and the rule holds."""

import numpy as np
import onnx
import pytest

from tinyserve_dev.cases import CaseSpec, make_case, make_mixed_case
from tinyserve_trt.ops import fine_bounds, schema, sparse_attention_ref
from tinyserve_trt.ops.node import make_node, make_op_model
from tinyserve_trt.ops.policies import get_policy, reduce_group
from tinyserve_trt.ops.two_level import select_sub_pages

from .conftest import run_op
from .test_cold_pages import run_mixed


def _attrs(rng, sub_page_size):
    return schema.OpAttributes(sub_page_size=sub_page_size, candidate_share=float(rng.choice([0.0, 0.25, 0.5, 1.0])),
                               sink_pages=int(rng.integers(0, 3)), recent_pages=int(rng.integers(1, 3)),
                               group_reduce=str(rng.choice(schema.GROUP_REDUCTIONS)))


def _check(out, sel, ref, ref_sel, dtype):
    tol = schema.TOLERANCES[dtype]
    np.testing.assert_allclose(out.astype(np.float64), ref.astype(np.float64), **tol)
    assert sel.shape == ref_sel.shape and sel.dtype == bool
    np.testing.assert_array_equal(sel, ref_sel)  # continuous random data: no ties


@pytest.mark.parametrize("dtype", schema.FLOAT_TYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])  # GQA 1/3/8
@pytest.mark.parametrize("page_size,sub_page_size", [(16, 4), (16, 2), (8, 4), (32, 4), (16, 16)])
def test_decode_matches_reference(rng, dtype, heads, kv_heads, page_size, sub_page_size):
    lens = tuple(int(x) for x in rng.integers(1, page_size * 12, int(rng.integers(2, 5))))  # ragged, partial pages
    attrs = _attrs(rng, sub_page_size)
    for budget in (sub_page_size, page_size, 3 * page_size + sub_page_size, 7 * page_size, 0, 10_000):
        case = make_case(CaseSpec(lens, heads, kv_heads, 16, page_size, 1, dtype, budget,
                                  sub_page_size=sub_page_size), rng)
        _check(*run_op(case, attrs, dtype), *sparse_attention_ref(**case, attrs=attrs), dtype)


@pytest.mark.parametrize("sub_page_size", [0, 4])
def test_equal_and_unequal_keep_counts(rng, sub_page_size):
    """Rows that all keep the same count rank with an unsorted TopK (any order); rows keeping different
    counts (per-sequence budgets, a dense row beside sparse ones) need the sorted one for the rank
    mask: both select what the reference does."""
    attrs = schema.OpAttributes(sub_page_size=sub_page_size)
    for lens, budgets in (((300,) * 3, (48,) * 3), ((300,) * 3, (48, 16, 96)), ((300, 300, 40), (64,) * 3)):
        case = make_case(CaseSpec(lens, 6, 2, 16, 16, 1, "float32", 0, sub_page_size=sub_page_size), rng)
        case["token_budget"] = np.array(budgets, dtype=np.int32)
        _check(*run_op(case, attrs, "float32"), *sparse_attention_ref(**case, attrs=attrs), "float32")


@pytest.mark.parametrize("lens,budgets", [((100, 97), (100, 100)), ((100, 300), (100, 100)), ((100, 300), (100, 40))])
def test_dense_by_sub_pages_only(rng, lens, budgets):
    """Budget 100 at page 32: 3 pages < 4 (the page rule selects) but 25 sub-pages of 4 cover all 25 written
    (the sub-page rule is dense). All rows so: the every-page branch; beside a selecting row: the sparse
    branch keeps the dense row's every written sub-page. Both as the reference."""
    attrs = schema.OpAttributes(sub_page_size=4, sink_pages=1, recent_pages=1)
    case = make_case(CaseSpec(lens, 6, 2, 16, 32, 1, "float32", 0, sub_page_size=4), rng)
    case["token_budget"] = np.array(budgets, dtype=np.int32)
    out, sel = run_op(case, attrs, "float32")
    ref, ref_sel = sparse_attention_ref(**case, attrs=attrs)
    _check(out, sel, ref, ref_sel, "float32")
    assert sel[0].all(axis=0)[: -(-lens[0] // 32)].all()  # the 100-token row attends all its pages


@pytest.mark.parametrize("dtype", schema.FLOAT_TYPES)
@pytest.mark.parametrize("granularity", [("channel", "token"), ("head", "head"), ("token", "channel")])
def test_cold_pages_match_reference(rng, dtype, granularity):
    lens = tuple(int(x) for x in rng.integers(1, 16 * 10, 3))
    attrs = _attrs(rng, 4)
    for budget in (8, 40, 0):
        spec = CaseSpec(lens, 8, 2, 16, 16, 1, dtype, budget, sub_page_size=4)
        case = make_mixed_case(spec, rng, float(rng.uniform(0.2, 0.8)), *granularity)
        _check(*run_mixed(case, attrs, dtype), *sparse_attention_ref(**case, attrs=attrs), dtype)


@pytest.mark.parametrize("dtype", schema.FLOAT_TYPES)
def test_prefill_attends_everything(rng, dtype):
    attrs = schema.OpAttributes(sub_page_size=4)
    case = make_case(CaseSpec((0, 7, 40, 16), 8, 2, 16, 16, 5, dtype, 16, sub_page_size=4), rng)
    out, sel = run_op(case, attrs, dtype)
    plain = sparse_attention_ref(**{k: v for k, v in case.items() if k != "key_sub_bounds"})  # single-level, dense
    np.testing.assert_allclose(out.astype(np.float64), plain[0].astype(np.float64), **schema.TOLERANCES[dtype])
    np.testing.assert_array_equal(sel, plain[1])


def test_sub_page_size_equal_to_page_size_is_single_level(rng):
    case = make_case(CaseSpec((300, 517, 45), 8, 2, 16, 16, 1, "float32", 96, sub_page_size=16), rng)
    two = schema.OpAttributes(sub_page_size=16)
    single = sparse_attention_ref(**{k: v for k, v in case.items() if k != "key_sub_bounds"})
    for out, sel in (run_op(case, two, "float32"), sparse_attention_ref(**case, attrs=two)):
        np.testing.assert_allclose(out, single[0], **schema.TOLERANCES["float32"])
        np.testing.assert_array_equal(sel, single[1])


def _kept_sub_pages(case, attrs, b, h):
    """Fine scores of the sub-pages the reference attends for (b, h), from the op's own definition."""
    ps, sp = case["key_cache"].shape[2], attrs.sub_page_size
    n = -(-int(case["past_lens"][b]) // ps)
    ids = case["page_table"][b, :n]
    G = case["query"].shape[1] // case["key"].shape[1]
    lo, hi = fine_bounds.decode(case["key_sub_bounds"][ids, h], case["key_min"][ids, h], case["key_max"][ids, h])
    q = case["query"][b, h * G:(h + 1) * G, 0].astype(np.float64)
    per_head = get_policy("query_aware").score_ref(q, lo.reshape(-1, lo.shape[-1]), hi.reshape(-1, hi.shape[-1]),
                                                   None, None, sp, 1.0)
    return reduce_group(per_head, attrs.group_reduce), n


def test_ties_keep_the_same_scores_and_output(rng):
    """Two pages with identical keys, values and metadata tie at both levels: which one is kept may
    differ, the output and the multiset of kept scores may not."""
    case = make_case(CaseSpec((400, 300), 8, 2, 16, 16, 1, "float32", 64, sub_page_size=4), rng)
    pt = case["page_table"]
    for src, dst in ((pt[0, 3], pt[0, 7]), (pt[1, 2], pt[1, 9])):
        for name in ("key_cache", "value_cache", "key_min", "key_max", "key_sub_bounds"):
            case[name][dst] = case[name][src]
    attrs = schema.OpAttributes(sub_page_size=4, candidate_share=0.25)
    out, sel = run_op(case, attrs, "float32")
    ref, ref_sel = sparse_attention_ref(**case, attrs=attrs)
    np.testing.assert_allclose(out, ref, **schema.TOLERANCES["float32"])
    for b in range(2):
        for h in range(2):
            fine, n = _kept_sub_pages(case, attrs, b, h)
            coarse_kept = fine.reshape(n, -1).max(1)  # a page's best sub-page, as a tie-proof page key
            np.testing.assert_allclose(np.sort(coarse_kept[sel[b, h, :n]]), np.sort(coarse_kept[ref_sel[b, h, :n]]))


def test_rule_counts_sub_pages(rng):
    """20 pages of 16, the last with 11 tokens; budget 64 = 16 sub-pages of 4; share 0.25 = 5 candidate
    pages, sink and last page among them. Kept: the 4 + 3 forced sub-pages, then the 9 best-scored
    sub-pages of the 3 best other pages."""
    coarse, fine = rng.standard_normal(20), rng.standard_normal(80)
    keep = select_sub_pages(coarse, fine, 20 * 16 - 5, 64, 16, 4, 0.25, 1, 1)
    assert keep.sum() == 16 and not keep[79]  # sub-page 79 holds no token
    assert keep[:4].all() and keep[76:79].all()
    cand = 1 + np.argsort(-coarse[1:19])[:3]
    cand_sub = (cand[:, None] * 4 + np.arange(4)).ravel()
    best = cand_sub[np.argsort(-fine[cand_sub])[:9]]
    assert set(np.flatnonzero(keep[4:76]) + 4) == set(best)
    assert select_sub_pages(coarse, fine, 20 * 16 - 5, 79 * 4, 16, 4, 0.25, 1, 1).sum() == 79  # covers all: dense
    assert select_sub_pages(coarse, fine, 20 * 16 - 5, 0, 16, 4, 0.25, 1, 1).sum() == 79


def test_node_validation_and_overloads():
    two = schema.OpAttributes(sub_page_size=4)
    hot = schema.node_input_names(two_level=True)
    assert hot[schema.NUM_REQUIRED_INPUTS:] == ("", "", "", "", "key_sub_bounds")
    assert make_node(list(hot), ["o"], two).overload == "query_aware_two_level"
    assert make_node(list(schema.node_input_names(True, True)), ["o"], two, cold_pages=True).overload == \
        "query_aware_two_level_int8"
    with pytest.raises(ValueError, match="needs 'key_sub_bounds'"):
        make_node(list(schema.node_input_names()), ["o"], two)
    with pytest.raises(ValueError, match="takes no 'key_sub_bounds'"):
        make_node(list(hot), ["o"], schema.OpAttributes())
    with pytest.raises(ValueError, match="sub_page_size"):
        schema.OpAttributes(policy="window", sub_page_size=4)
    with pytest.raises(ValueError, match="candidate_share"):
        schema.OpAttributes(sub_page_size=4, candidate_share=1.5)
    for cold in (False, True):
        onnx.checker.check_model(make_op_model("float16", two, cold_pages=cold), full_check=True)


@pytest.mark.parametrize("opset", [17, 18, 20, 23])
def test_two_level_body_for_the_model_opset(rng, opset):
    import onnxruntime as ort

    from tinyserve_trt.ops.node import attach_functions
    attrs = schema.OpAttributes(sub_page_size=4)
    model = make_op_model("float32", attrs)
    model.opset_import[0].version = opset
    del model.functions[:]
    attach_functions(model)
    onnx.checker.check_model(model, full_check=True)
    case = make_case(CaseSpec((170, 33), 4, 2, 16, 16, 1, "float32", 32, sub_page_size=4), rng)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out, _ = sess.run(None, {n: case[n] for n in schema.node_input_names(two_level=True) if n})
    np.testing.assert_allclose(out, sparse_attention_ref(**case, attrs=attrs)[0], **schema.TOLERANCES["float32"])
