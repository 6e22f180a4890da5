"""group_reduce="head" in the CUDA kernels (each query head of a GQA group selects alone) against numpy.

Marked ``gpu``; without CUDA the ``cuda_lib`` fixture runs the same kernel sources in the CPU
emulation (the only place these have run so far: never on a GPU). The reference for one query
head's selection is the shared rule with groups of one on ``per_query_head_case`` (each KV head's
pages repeated for its query heads), so the checks of the shared tests apply per query head: the
kernel's kept list (a row per query head, ``ForwardCall.kept_units``) against the rule by the
reference's scores (STYLE principle 8), ``selected_pages`` against the union of the group's kept
lists (``group_union``), the output against the attention over each head's own kept units, and,
when the kept sets are the reference's, output and ``selected_pages`` against
``sparse_attention_ref`` with ``group_reduce="head"`` itself.
"""

from dataclasses import replace

import numpy as np
import pytest

from tinyserve_dev.cases import CaseSpec, dequantized_float32_case, make_case, make_mixed_case
from tinyserve_dev.kernels.references import (attention_with_selection_ref, group_union,
                                              kept_sub_pages_ref, per_query_head_case, selection_score_gap,
                                              sub_page_selection_gap, units_mask)
from tinyserve_trt.ops import schema, sparse_attention_ref

from .test_kernels_gpu import LENS, _assert_close, _assert_mixed

pytestmark = pytest.mark.gpu

# per sequence of LENS (0, 5, 64, 130, 300): one page, dense (0), sparse, sparse, sparse
BUDGETS = (16, 0, 32, 48, 96)


def _case(spec, rng, budgets=BUDGETS, **mixed):
    case = make_mixed_case(spec, rng, **mixed) if mixed else make_case(spec, rng)
    case["token_budget"] = np.asarray(budgets, dtype=np.int32)
    return case


def run_per_head(case, attrs, dtype, num_splits=0, heads_differ=True):
    """Kernel (group_reduce head) vs the per-query-head reference for one decode case; returns the
    kernel's kept units ``[B, H, NP * r]``. ``heads_differ``: the reference's heads of some group keep
    different units (else a shared selection would pass the same checks)."""
    from tinyserve_dev.kernels.harness import ForwardCall

    assert attrs.group_reduce == "head" and attrs.policy == "query_aware"
    call = ForwardCall(**case, attrs=attrs, num_splits=num_splits)
    call.launch()
    call.dev.synchronize()
    call.dev.check_flags(call.flags, "qsa_forward")
    out, sel = call.output.cpu().numpy(), call.selected.cpu().numpy()
    assert np.isin(sel, (0, 1)).all(), "selected_pages entries were never written"
    B, H = case["query"].shape[:2]
    Hkv, NP = sel.shape[1:]
    assert call.per_head and call.kept_rows == H
    hcase, shared = per_query_head_case(case), replace(attrs, group_reduce="max")  # groups of one
    r = case["key_cache"].shape[2] // attrs.sub_page_size if attrs.two_level else 1
    got = units_mask(call.kept_units(), NP * r)  # [B, H, NP * r]
    if attrs.two_level:
        want = kept_sub_pages_ref(hcase, shared)
        gap = sub_page_selection_gap(hcase, got, want, shared)
    else:
        want = sparse_attention_ref(**hcase, attrs=shared)[1]
        gap = selection_score_gap(hcase, got, want, shared)
    assert gap <= 1e-4 * max(1.0, np.abs(case["query"]).max()), f"kept units score worse by {gap}"
    if heads_differ:
        per_group = want.reshape(B, Hkv, H // Hkv, -1)
        assert (per_group != per_group[:, :, :1]).any(), "every group's heads keep the same units: head untested"
    np.testing.assert_array_equal(sel.astype(bool), group_union(got, Hkv, r),
                                  err_msg="selected_pages vs the union of the group's kept units")
    _assert_close(out, attention_with_selection_ref(hcase, got, shared), dtype, "output vs each head's kept units")
    if np.array_equal(got, want):
        ref_out, ref_sel = sparse_attention_ref(**case, attrs=attrs)
        np.testing.assert_array_equal(sel.astype(bool), ref_sel, err_msg="selected_pages vs sparse_attention_ref")
        _assert_close(out, ref_out, dtype, "output vs sparse_attention_ref")
    return got


def _run_direct(case, attrs, dtype):
    """Kernel vs ``sparse_attention_ref`` where the selection has no near-ties (window, dense, prefill)."""
    from tinyserve_dev.kernels.harness import sparse_attention_gpu

    out, sel = sparse_attention_gpu(**case, attrs=attrs)
    ref_out, ref_sel = sparse_attention_ref(**case, attrs=attrs)
    np.testing.assert_array_equal(sel, ref_sel)
    _assert_close(out, ref_out, dtype, "output vs sparse_attention_ref")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("heads", [(8, 2), (14, 2)])  # GQA groups of 4 and 7
def test_head_single_level_decode(cuda_lib, rng, dtype, heads):
    case = _case(CaseSpec(LENS, heads[0], heads[1], 64, 16, 1, dtype), rng)
    run_per_head(case, schema.OpAttributes(group_reduce="head"), dtype)


@pytest.mark.parametrize("dtype,share,heads", [("float32", 1.0, (8, 2)), ("float16", 1.0, (14, 2)),
                                               ("float32", 0.5, (14, 2)), ("float16", 0.5, (8, 2))])
def test_head_two_level_decode(cuda_lib, rng, dtype, share, heads):
    """Every page a candidate (the export default), and a candidate cut per head."""
    case = _case(CaseSpec(LENS, heads[0], heads[1], 64, 16, 1, dtype, sub_page_size=4), rng)
    run_per_head(case, schema.OpAttributes(group_reduce="head", sub_page_size=4, candidate_share=share), dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_head_split_counts(cuda_lib, rng, num_splits):
    """Each query head's kept list cut into splits; a split may start mid-page."""
    case = _case(CaseSpec((300, 17), 8, 2, 64, 8, 1, "float16", sub_page_size=2), rng, (118, 6))
    run_per_head(case, schema.OpAttributes(group_reduce="head", sub_page_size=2), "float16", num_splits=num_splits)


def test_head_group_past_one_block(cuda_lib, rng):
    """A group of 12 (two chunks of 8 + 4 heads when shared): per head, query head 11 reads its own row."""
    case = _case(CaseSpec((100, 260), 12, 1, 32, 16, 1, "float32", sub_page_size=4), rng, (36, 64))
    run_per_head(case, schema.OpAttributes(group_reduce="head", sub_page_size=4, candidate_share=0.5), "float32")


def test_head_scores_spill_to_workspace(cuda_lib, rng):
    """>10K pages: each query head's page scores in its own workspace row."""
    case = _case(CaseSpec((12_000,), 2, 1, 16, 1, 1, "float32", spare_pages=0), rng, (3000,))
    run_per_head(case, schema.OpAttributes(group_reduce="head", sink_pages=4, recent_pages=64), "float32")


def test_head_group_of_one_equals_max(cuda_lib, rng):
    """H == Hkv: a query head per KV head, so head and max select alike."""
    from tinyserve_dev.kernels.harness import sparse_attention_gpu

    case = _case(CaseSpec(LENS, 4, 4, 32, 16, 1, "float32", sub_page_size=4), rng)
    attrs = schema.OpAttributes(group_reduce="head", sub_page_size=4)
    run_per_head(case, attrs, "float32", heads_differ=False)
    out, sel = sparse_attention_gpu(**case, attrs=attrs)
    max_out, max_sel = sparse_attention_gpu(**case, attrs=replace(attrs, group_reduce="max"))
    np.testing.assert_array_equal(sel, max_sel)
    np.testing.assert_array_equal(out, max_out)


@pytest.mark.parametrize("policy", ["window", "dense"])
def test_head_query_free_policies_share_units(cuda_lib, rng, policy):
    """Window and dense do not read the query: every head would select alike, so head runs them shared."""
    from tinyserve_dev.kernels.harness import ForwardCall

    case = _case(CaseSpec(LENS, 14, 2, 32, 16, 1, "float16"), rng)
    attrs = schema.OpAttributes(policy=policy, group_reduce="head")
    assert ForwardCall(**case, attrs=attrs).kept_rows == 2
    _run_direct(case, attrs, "float16")


@pytest.mark.parametrize("two_level", [False, True])
def test_head_mixed_int8_cold_pages(cuda_lib, rng, two_level):
    spec = CaseSpec(LENS, 8, 2, 64, 16, 1, "float32", sub_page_size=4 if two_level else 0)
    case = _case(spec, rng, cold_fraction=0.5)
    _assert_mixed(case)
    attrs = schema.OpAttributes(group_reduce="head", sub_page_size=spec.sub_page_size)
    got = run_per_head(case, attrs, "float32", num_splits=3)
    from tinyserve_dev.kernels.harness import sparse_attention_gpu

    out, _ = sparse_attention_gpu(**case, attrs=attrs, num_splits=3)
    hot = per_query_head_case(dequantized_float32_case(case))
    _assert_close(out, attention_with_selection_ref(hot, got, replace(attrs, group_reduce="max")), "float32",
                  "output vs dequantized all-hot cache")


def test_head_int4_cold_pages_two_level(cuda_lib, rng):
    """Packed INT4 cold keys on each sub-page's decoded bounds, read per query head."""
    spec = CaseSpec(LENS, 8, 2, 64, 16, 1, "float16", sub_page_size=4)
    case = _case(spec, rng, cold_fraction=0.5, cold_format="int4", group_size=16)
    _assert_mixed(case)
    run_per_head(case, schema.OpAttributes(group_reduce="head", sub_page_size=4, cold_format="int4"), "float16",
                 num_splits=2)


@pytest.mark.parametrize("sub_page_size", [0, 4])
def test_head_prefill_attends_every_page(cuda_lib, rng, sub_page_size):
    """S > 1: no selection with head either; every valid page, causal over the new tokens."""
    case = make_case(CaseSpec(LENS, 14, 2, 32, 16, 3, "float16", budget=16, sub_page_size=sub_page_size), rng)
    _run_direct(case, schema.OpAttributes(group_reduce="head", sub_page_size=sub_page_size), "float16")
