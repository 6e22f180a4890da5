"""Two-level selection in the CUDA kernels (sub_page_size > 0) against the numpy rule.

Marked ``gpu``; on a machine without CUDA the ``cuda_lib`` fixture runs the same
kernel sources in the CPU emulation. Each case is checked four ways:
the kernel's kept sub-page list (read from its workspace, ``ForwardCall.kept_units``)
against ``ops.two_level`` by the reference's sub-page scores (STYLE principle 8:
scores, not indices, as a float32 near-tie may keep another equally scored sub-page);
``selected_pages`` against the pages of that list; the output against the
reference's attention over exactly the kept sub-pages; and, when the kept sets are
the same, output and ``selected_pages`` against ``sparse_attention_ref`` itself.
"""

from dataclasses import replace

import numpy as np
import pytest

from tinyserve_dev.cases import CaseSpec, dequantized_float32_case, make_case, make_mixed_case
from tinyserve_dev.kernels.references import (attention_with_selection_ref,
                                              kept_sub_pages_ref, sub_page_selection_gap, units_mask)
from tinyserve_trt.ops import schema, sparse_attention_ref

pytestmark = pytest.mark.gpu

LENS = (0, 5, 64, 130, 300)  # empty, partial first page, exact pages, 2 tokens in the last page, longer
# per sequence of LENS: one sub-page, dense (0), sparse, sparse, sparse / budgets near the edges
BUDGETS = {"sparse": (16, 0, 8, 24, 60), "edges": (4, 5, 1000, 52, 132)}


def _assert_close(got, want, dtype, what):
    tol = schema.TOLERANCES[dtype]
    assert not np.isnan(got).any(), f"{what}: NaN left in the output (a row was never written)"
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), err_msg=what, **tol)


def run_two_level(case, attrs, dtype, num_splits=0):
    """Kernel vs reference for one decode case; returns (kept mask, reference kept mask)."""
    from tinyserve_dev.kernels.harness import ForwardCall

    call = ForwardCall(**case, attrs=attrs, num_splits=num_splits)
    call.launch()
    call.dev.synchronize()
    call.dev.check_flags(call.flags, "qsa_forward")
    out = call.output.cpu().numpy()
    sel = call.selected.cpu().numpy()
    assert np.isin(sel, (0, 1)).all(), "selected_pages entries were never written"
    B, Hkv, NP = sel.shape
    r = case["key_cache"].shape[2] // attrs.sub_page_size
    got = units_mask(call.kept_units(), NP * r)
    want = kept_sub_pages_ref(case, attrs)
    gap = sub_page_selection_gap(case, got, want, attrs)
    assert gap <= 1e-4 * max(1.0, np.abs(case["query"]).max()), f"kept sub-pages score worse by {gap}"
    np.testing.assert_array_equal(sel.astype(bool), got.reshape(B, Hkv, NP, r).any(-1),
                                  err_msg="selected_pages vs the pages of the kept sub-pages")
    _assert_close(out, attention_with_selection_ref(case, got, attrs), dtype, "output vs kept sub-pages")
    if np.array_equal(got, want):
        ref_out, ref_sel = sparse_attention_ref(**case, attrs=attrs)
        np.testing.assert_array_equal(sel.astype(bool), ref_sel)
        _assert_close(out, ref_out, dtype, "output vs sparse_attention_ref")
    return got, want


def _case(spec, rng, budgets):
    case = make_case(spec, rng)
    case["token_budget"] = np.asarray(budgets, dtype=np.int32)
    return case


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])  # GQA group 1 and 4
@pytest.mark.parametrize("share,group_reduce", [(0.25, "max"), (0.5, "sum")])
@pytest.mark.parametrize("budgets", sorted(BUDGETS))
def test_two_level_decode_matches_reference(cuda_lib, rng, dtype, heads, share, group_reduce, budgets):
    spec = CaseSpec(LENS, heads[0], heads[1], 64, 16, 1, dtype, sub_page_size=4)
    case = _case(spec, rng, BUDGETS[budgets])
    attrs = schema.OpAttributes(sub_page_size=4, candidate_share=share, group_reduce=group_reduce)
    got, want = run_two_level(case, attrs, dtype)
    # the case exercises both levels: a page partly kept, and a candidate cut that matters
    r = 4
    per_page = want.reshape(*want.shape[:2], -1, r).sum(-1)
    assert ((per_page > 0) & (per_page < r)).any(), "no page was kept partially: level 2 untested"
    if budgets == "sparse":
        uncut = kept_sub_pages_ref(case, replace(attrs, candidate_share=1.0))
        assert not np.array_equal(uncut, want), "candidate_share changed nothing: level 1 untested"


@pytest.mark.parametrize("page_size,sub_page_size", [(16, 2), (16, 8), (8, 4), (32, 4)])
def test_two_level_sub_page_sizes(cuda_lib, rng, page_size, sub_page_size):
    spec = CaseSpec((37, 200, 300), 8, 2, 32, page_size, 1, "float32", sub_page_size=sub_page_size)
    case = _case(spec, rng, (sub_page_size, 3 * sub_page_size + 1, 70))
    run_two_level(case, schema.OpAttributes(sub_page_size=sub_page_size, candidate_share=0.3), "float32")


@pytest.mark.parametrize("dtype,head_dim", [("float32", 80), ("float32", 128), ("float16", 20), ("float16", 256)])
def test_two_level_head_dims(cuda_lib, rng, dtype, head_dim):
    """Lanes past D masked in the bound decode; fp16 rows that are not whole 16-byte vectors."""
    spec = CaseSpec((37, 200), 4, 2, head_dim, 16, 1, dtype, sub_page_size=4)
    case = _case(spec, rng, (20, 52))
    run_two_level(case, schema.OpAttributes(sub_page_size=4, sink_pages=2, recent_pages=2), dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_two_level_split_counts(cuda_lib, rng, num_splits):
    """Splits cut the kept list by sub-pages: a split may start mid-page."""
    spec = CaseSpec((300, 17), 8, 2, 64, 8, 1, "float16", sub_page_size=2)
    case = _case(spec, rng, (118, 6))
    run_two_level(case, schema.OpAttributes(sub_page_size=2), "float16", num_splits=num_splits)


@pytest.mark.parametrize("heads", [(8, 1), (12, 1)])  # one group in a block; a group split over two blocks
def test_two_level_large_groups(cuda_lib, rng, heads):
    spec = CaseSpec((100, 260), heads[0], heads[1], 64, 16, 1, "float32", sub_page_size=4)
    case = _case(spec, rng, (36, 64))
    run_two_level(case, schema.OpAttributes(sub_page_size=4, group_reduce="sum"), "float32")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("granularity", [("channel", "token"), ("head", "head")])
def test_two_level_mixed_cold_pages(cuda_lib, rng, dtype, granularity):
    """INT8 cold pages: sub-page bounds encode their dequantized keys; the decode dequantizes."""
    spec = CaseSpec(LENS, 8, 2, 64, 16, 1, dtype, sub_page_size=4)
    case = make_mixed_case(spec, rng, 0.5, *granularity)
    case["token_budget"] = np.asarray(BUDGETS["sparse"], dtype=np.int32)
    P = case["key_cache"].shape[0]
    ids = np.concatenate([case["page_table"][b, : -(-int(n) // 16)] for b, n in enumerate(case["past_lens"])])
    assert (ids < P).any() and (ids >= P).any(), "case does not mix hot and cold pages"
    attrs = schema.OpAttributes(sub_page_size=4)
    got, _ = run_two_level(case, attrs, dtype)
    hot = dequantized_float32_case(case)
    from tinyserve_dev.kernels.harness import sparse_attention_gpu

    out, _ = sparse_attention_gpu(**case, attrs=attrs)
    _assert_close(out, attention_with_selection_ref(hot, got, attrs), dtype, "output vs dequantized all-hot cache")


def test_two_level_scores_spill_to_workspace(cuda_lib, rng):
    """>10K pages: the page scores leave shared memory for the workspace (as single-level)."""
    spec = CaseSpec((20_500,), 2, 1, 16, 2, 1, "float32", spare_pages=0, sub_page_size=1)
    case = _case(spec, rng, (3000,))
    run_two_level(case, schema.OpAttributes(sub_page_size=1, sink_pages=4, recent_pages=64,
                                            candidate_share=0.2), "float32")


def test_two_level_ties_keep_lowest_index(cuda_lib, rng):
    """Sub-pages with identical bounds score exactly alike: the lower sub-page index wins, as in numpy."""
    spec = CaseSpec((160,), 2, 1, 32, 16, 1, "float32", sub_page_size=4)
    case = _case(spec, rng, (44,))
    table = case["page_table"][0]
    for lp in range(1, 9):  # pages 1..8: page 1's metadata, every sub-page the same codes
        case["key_min"][table[lp]] = case["key_min"][table[1]]
        case["key_max"][table[lp]] = case["key_max"][table[1]]
        case["key_sub_bounds"][table[lp]] = case["key_sub_bounds"][table[1], :, :1]
    got, want = run_two_level(case, schema.OpAttributes(sub_page_size=4, candidate_share=0.6), "float32")
    np.testing.assert_array_equal(got, want)


def test_two_level_prefill_marks_every_page(cuda_lib, rng):
    """S > 1: no selection, two-level or not; every valid page attended."""
    from tinyserve_dev.kernels.harness import sparse_attention_gpu

    case = make_case(CaseSpec(LENS, 8, 2, 64, 16, 3, "float16", budget=16, sub_page_size=4), rng)
    attrs = schema.OpAttributes(sub_page_size=4)
    out, sel = sparse_attention_gpu(**case, attrs=attrs)
    ref_out, ref_sel = sparse_attention_ref(**case, attrs=attrs)
    np.testing.assert_array_equal(sel, ref_sel)
    _assert_close(out, ref_out, "float16", "prefill output")


def test_sub_page_size_equal_to_page_size_is_single_level(cuda_lib, rng):
    """sub_page_size == ps selects exactly as single-level; key_sub_bounds is not needed."""
    from tinyserve_dev.kernels.harness import sparse_attention_gpu

    case = make_case(CaseSpec(LENS, 8, 2, 32, 16, 1, "float32", budget=48), rng)
    out, sel = sparse_attention_gpu(**case, attrs=schema.OpAttributes(sub_page_size=16))
    base_out, base_sel = sparse_attention_gpu(**case, attrs=schema.OpAttributes())
    np.testing.assert_array_equal(sel, base_sel)
    np.testing.assert_array_equal(out, base_out)


def test_two_level_without_bounds_is_refused(cuda_lib, rng):
    from tinyserve_dev.kernels.harness import sparse_attention_gpu

    case = make_case(CaseSpec((40,), 2, 1, 16, 16, 1, "float32", budget=16), rng)
    with pytest.raises(ValueError, match="key_sub_bounds"):
        sparse_attention_gpu(**case, attrs=schema.OpAttributes(sub_page_size=4))
