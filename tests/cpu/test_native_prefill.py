"""The native node's prefill (S > 1, ``qsa_prefill.h``) equals the numpy reference: every cached
token plus the new tokens up to each one (causal), hot and cold pages, ragged batches, GQA groups,
page sizes below, at and above the kernel's key block, head dims that are not a whole number of
vectors; ``selected_pages`` marks every page a sequence holds."""

from __future__ import annotations

import numpy as np
import pytest

from tinyserve_dev.cases import CaseSpec, make_case
from tinyserve_trt.cpu import native
from tinyserve_trt.ops import schema, sparse_attention_ref

from .test_native_op import COLD_LAYOUTS, _error, check_case, cold_case, ragged_lens

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"native CPU op unavailable: "
                                f"{native.available()}")


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (14, 2)])
@pytest.mark.parametrize("new_tokens", [2, 7, 70])
def test_prefill_matches_reference(rng, heads, kv_heads, new_tokens):
    """Ragged cached lengths (an empty cache, a partial and a page-aligned last page) and more new
    tokens than a key block (64) or a task's token block hold."""
    lens = ragged_lens(rng, 16)
    case = make_case(CaseSpec(lens, heads, kv_heads, 32, 16, new_tokens=new_tokens, budget=16), rng)
    check_case(case, schema.OpAttributes(group_reduce="head"))


@pytest.mark.parametrize("page_size", [8, 32, 48, 128])
@pytest.mark.parametrize("head_dim", [20, 64, 80])
def test_prefill_page_sizes_and_head_dims(rng, page_size, head_dim):
    """Pages smaller than a key block (several per block), one that fills it, one that does not
    divide it, one larger (split over blocks); head dims padded to the vector width."""
    lens = (3 * page_size + 5, 0, 2 * page_size)
    case = make_case(CaseSpec(lens, 6, 3, head_dim, page_size, new_tokens=33, budget=page_size), rng)
    check_case(case, schema.OpAttributes())


@pytest.mark.parametrize("sp", [0, 4])
def test_prefill_ignores_the_selection(rng, sp):
    """Selection does not apply to S > 1: every budget, policy and group reduction attends every
    cached token (the budget is 1 page here)."""
    lens = (200, 45)
    case = make_case(CaseSpec(lens, 6, 2, 32, 16, new_tokens=9, budget=16, sub_page_size=sp), rng)
    for gr in schema.GROUP_REDUCTIONS:
        check_case(case, schema.OpAttributes(sub_page_size=sp, group_reduce=gr))
    if not sp:
        check_case(case, schema.OpAttributes(policy="dense"))


@pytest.mark.parametrize("layout", COLD_LAYOUTS, ids=lambda x: "-".join(map(str, x)))
@pytest.mark.parametrize("sp", [0, 4])
def test_prefill_over_cold_pages(rng, layout, sp):
    """Cached pages of both tiers, dequantized as ops/cold_codec.py does (INT4 keys on the
    sub-page bounds when two-level), mixed inside one key block."""
    attrs = schema.OpAttributes(sub_page_size=sp, cold_format=layout[0])
    kw = dict(num_heads=6, num_kv_heads=2, head_dim=32, page_size=16, budget=16, sub_page_size=sp, new_tokens=5)
    check_case(cold_case(rng, ragged_lens(rng, 16), kw, layout), attrs)
    kw = dict(kw, page_size=32, head_dim=64, num_heads=9, num_kv_heads=3, new_tokens=3)
    check_case(cold_case(rng, (700,), kw, layout, 0.7), attrs)


def test_prefill_of_a_peaked_softmax(rng):
    """Logits far apart (one key dominates, the running max moves late): the online softmax's
    rescaling keeps float32 accuracy."""
    case = make_case(CaseSpec((300, 90), 4, 2, 32, 16, new_tokens=40, budget=16), rng)
    case["query"] = case["query"] * 6.0
    ref, _ = sparse_attention_ref(**case, attrs=schema.OpAttributes())
    assert np.isfinite(ref).all()
    check_case(case, schema.OpAttributes(), tol=dict(atol=4e-5, rtol=4e-5))


def test_no_new_token_is_one_line(rng):
    case = make_case(CaseSpec((20, 3), 4, 2, 16, 8, new_tokens=1, budget=8), rng)
    for name in ("query", "key", "value"):
        case[name] = case[name][:, :, :0]
    _error(case, schema.OpAttributes(), r"QueryAwareSparseAttentionDecode: query has no new token \(S=0\)")
