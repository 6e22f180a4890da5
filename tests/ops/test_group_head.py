"""group_reduce="head": each query head of a GQA group selects and attends alone.

The definition, checked independently of the reference's own loop: the op with ``head`` on ``H``
query heads over ``Hkv`` KV heads equals the op with the KV heads repeated ``G`` times (a group of
one: no reduction to choose), and its ``selected_pages`` is the OR of the repeated heads' selections.
"""

import numpy as np
import pytest

from tinyserve_dev.cases import CaseSpec, make_case, make_mixed_case
from tinyserve_trt.ops import schema, sparse_attention_ref

_BY_KV_HEAD = ("key", "value", "key_cache", "value_cache", "key_min", "key_max", "key_cache_int8", "value_cache_int8",
               "key_scale", "value_scale", "key_sub_bounds")  # inputs with Hkv on axis 1


def repeat_kv_heads(case: dict, G: int) -> dict:
    """``case`` with every KV head repeated ``G`` times in place (head h -> h*G .. h*G + G-1)."""
    return {k: (np.repeat(v, G, axis=1) if k in _BY_KV_HEAD and v is not None else v) for k, v in case.items()}


def _case(rng, heads, kv_heads, ps, sp, cold, budget):
    lens = tuple(int(x) for x in rng.integers(ps, ps * 14, 3))
    spec = CaseSpec(lens, heads, kv_heads, 16, ps, 1, "float32", budget, sub_page_size=sp)
    return make_mixed_case(spec, rng, cold_format=cold) if cold else make_case(spec, rng)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("sub_page_size", [0, 4])
@pytest.mark.parametrize("cold", [None, "int8", "int4"])
def test_head_equals_groups_of_one(rng, heads, kv_heads, sub_page_size, cold):
    G = heads // kv_heads
    for budget in (16, 40, 72, 0):
        case = _case(rng, heads, kv_heads, 16, sub_page_size, cold, budget)
        attrs = schema.OpAttributes(group_reduce="head", sub_page_size=sub_page_size, candidate_share=1.0,
                                    cold_format=cold or "int8")
        out, sel = sparse_attention_ref(**case, attrs=attrs)
        alone, alone_sel = sparse_attention_ref(**repeat_kv_heads(case, G), attrs=attrs)
        np.testing.assert_allclose(out, alone, rtol=1e-12, atol=1e-12)
        B, _, NP = alone_sel.shape
        np.testing.assert_array_equal(sel, alone_sel.reshape(B, kv_heads, G, NP).any(axis=2))


@pytest.mark.parametrize("sub_page_size", [0, 4])
def test_head_differs_from_a_shared_selection(rng, sub_page_size):
    """The heads of a group choose differently on random data: a shared rule gives another output
    (so the test above fails if ``head`` is computed as ``max``)."""
    case = _case(rng, 8, 2, 16, sub_page_size, None, 64)  # 4 of up to 14 pages: 2 chosen
    out = {gr: sparse_attention_ref(**case, attrs=schema.OpAttributes(group_reduce=gr, sub_page_size=sub_page_size))
           for gr in ("head", "max")}
    assert not np.allclose(out["head"][0], out["max"][0], atol=1e-6)
    assert out["head"][1].sum() > out["max"][1].sum()  # the union of per-head choices is wider


@pytest.mark.parametrize("dtype", schema.FLOAT_TYPES)
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("sub_page_size", [0, 4])
@pytest.mark.parametrize("cold", [None, "int8", "int4"])
def test_onnx_function_matches_reference(rng, dtype, heads, kv_heads, sub_page_size, cold):
    """The ONNX body's per-head path (selection per query head, K/V gathered per query head) in ORT,
    across dense, mixed and sparse steps (a budget covering a sequence makes its row dense)."""
    from .test_cold_pages import run_mixed, run_mixed4  # noqa: PLC0415 (ORT sessions)
    from .conftest import run_op  # noqa: PLC0415

    attrs = schema.OpAttributes(group_reduce="head", sub_page_size=sub_page_size, cold_format=cold or "int8",
                                candidate_share=float(rng.choice([0.25, 1.0])), sink_pages=int(rng.integers(0, 2)))
    run = {None: run_op, "int8": run_mixed, "int4": run_mixed4}[cold]
    for budget in (16, 40, 72, 0, 10_000):
        lens = tuple(int(x) for x in rng.integers(1, 16 * 14, int(rng.integers(1, 4))))
        spec = CaseSpec(lens, heads, kv_heads, 16, 16, 1, dtype, budget, sub_page_size=sub_page_size)
        case = make_mixed_case(spec, rng, cold_format=cold) if cold else make_case(spec, rng)
        out, sel = run(case, attrs, dtype)
        ref, ref_sel = sparse_attention_ref(**case, attrs=attrs)
        np.testing.assert_allclose(out.astype(np.float64), ref.astype(np.float64), **schema.TOLERANCES[dtype])
        assert sel.shape == ref_sel.shape and sel.dtype == bool
        np.testing.assert_array_equal(sel, ref_sel)


def test_onnx_prefill_with_head_is_causal_attention(rng):
    """S > 1 takes the every-page branch ([B, Hkv] heads) beside the per-head one: same output."""
    from .conftest import run_op  # noqa: PLC0415

    attrs = schema.OpAttributes(group_reduce="head", sub_page_size=4)
    case = make_case(CaseSpec((0, 7, 40, 100), 8, 2, 16, 16, 5, "float32", 32, sub_page_size=4), rng)
    out, sel = run_op(case, attrs, "float32")
    ref, ref_sel = sparse_attention_ref(**case, attrs=attrs)
    np.testing.assert_allclose(out, ref, **schema.TOLERANCES["float32"])
    np.testing.assert_array_equal(sel, ref_sel)


@pytest.mark.parametrize("heads,kv_heads", [(2, 1), (6, 2), (14, 2)])
@pytest.mark.parametrize("sub_page_size", [0, 4])
@pytest.mark.parametrize("cold", [None, "int4"])
def test_native_node_matches_reference(rng, heads, kv_heads, sub_page_size, cold):
    """The CPU node's per-query-head tasks: batch 1 with few tasks (the attention split in chunks)
    and batch 3 (a task each), the selected_pages union of a group's heads run on different threads."""
    from tests.cpu.test_native_op import check_case  # noqa: PLC0415 (builds the native library)

    attrs = schema.OpAttributes(group_reduce="head", sub_page_size=sub_page_size, candidate_share=1.0,
                                cold_format=cold or "int8")
    for batch in (1, 3):
        for budget in (32, 72, 0):
            lens = tuple(int(x) for x in rng.integers(100, 16 * 14, batch))
            spec = CaseSpec(lens, heads, kv_heads, 32, 16, 1, "float32", budget, sub_page_size=sub_page_size)
            check_case(make_mixed_case(spec, rng, cold_format=cold) if cold else make_case(spec, rng), attrs)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 32), (14, 2, 12), (66, 1, 8)])
@pytest.mark.parametrize("sub_page_size", [0, 4])
def test_native_node_head_masks(rng, heads, kv_heads, head_dim, sub_page_size):
    """The CPU node attends a group's per-head selections in one task, each row for the heads that
    keep it: without sink pages a head may keep no row of an attention chunk (batch 1, the rows
    split in two); D = 12 takes the unblocked path; a group of 66 heads (more than a row's head
    mask holds) runs a task per query head."""
    from tests.cpu.test_native_op import check_case  # noqa: PLC0415 (builds the native library)

    attrs = schema.OpAttributes(group_reduce="head", sub_page_size=sub_page_size, candidate_share=1.0,
                                sink_pages=0, recent_pages=1)
    for batch in (1, 2):
        for budget in (16, 48):
            lens = tuple(int(x) for x in rng.integers(120, 16 * 12, batch))
            spec = CaseSpec(lens, heads, kv_heads, head_dim, 16, 1, "float32", budget, sub_page_size=sub_page_size)
            check_case(make_case(spec, rng), attrs)
