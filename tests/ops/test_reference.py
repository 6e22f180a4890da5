"""The reference against independent formulations: plain attention, the score bound."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tinyserve_trt.ops import schema, select_pages, sparse_attention_ref
from tinyserve_dev.cases import CaseSpec, contiguous_kv, make_case
from tinyserve_trt.ops.policies import get_policy

from .conftest import run_op


def plain_attention(case, b, scale=None):
    """softmax(q k^T) v over the contiguous cache + new tokens, GQA by repeating K/V."""
    k, v = contiguous_kv(case, b)
    q = case["query"][b].astype(np.float64)  # [H, S, D]
    H, S, D = q.shape
    G = H // k.shape[0]
    k = np.concatenate([k, case["key"][b].astype(np.float64)], axis=1).repeat(G, axis=0)
    v = np.concatenate([v, case["value"][b].astype(np.float64)], axis=1).repeat(G, axis=0)
    logits = np.einsum("hsd,htd->hst", q, k) * (scale or 1 / np.sqrt(D))
    past = k.shape[1] - S
    causal = np.arange(k.shape[1])[None, :] <= past + np.arange(S)[:, None]
    logits = np.where(causal[None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("hst,htd->hsd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("budget", [0, 10_000])  # 0 and >= context both mean dense
@pytest.mark.parametrize("new_tokens", [1, 3])
def test_dense_equals_plain_attention(rng, budget, new_tokens):
    spec = CaseSpec((5, 64, 130), 8, 2, 32, 16, new_tokens, "float32", budget)
    case = make_case(spec, rng)
    out, _ = run_op(case, schema.OpAttributes(), "float32")
    ref, sel = sparse_attention_ref(**case)
    for b in range(3):
        plain = plain_attention(case, b)
        np.testing.assert_allclose(ref[b], plain, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(out[b], plain, atol=1e-5, rtol=1e-5)
    assert sel.sum() == 2 * sum(-(-n // 16) for n in spec.past_lens)


def test_sparse_differs_from_dense(rng):
    """Guard against a budget that is silently ignored."""
    case = make_case(CaseSpec((512,), 4, 2, 16, 16, 1, "float32", 64), rng)
    sparse, sel = run_op(case, schema.OpAttributes(), "float32")
    assert sel.sum(-1).tolist() == [[4, 4]]
    assert np.abs(sparse[0] - plain_attention(case, 0)).max() > 1e-4


def test_explicit_scale(rng):
    case = make_case(CaseSpec((40,), 4, 4, 16, 8, 1, "float32", 0), rng)
    out, _ = run_op(case, schema.OpAttributes(scale=0.5), "float32")
    np.testing.assert_allclose(out[0], plain_attention(case, 0, scale=0.5), atol=1e-5, rtol=1e-5)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 16), st.integers(1, 32), st.data())
def test_score_bounds_every_dot_product(ps, d, data):
    """sum_i max(q_i min_i, q_i max_i) >= q.k for every key k in the page."""
    floats = st.floats(-100, 100, allow_nan=False, width=32)
    keys = data.draw(arrays(np.float64, (ps, d), elements=floats))
    q = data.draw(arrays(np.float64, (1, d), elements=floats))
    score = get_policy("query_aware").score_ref(q, keys.min(0)[None], keys.max(0)[None], keys, None, ps, 1.0)
    assert np.all(score[0, 0] >= keys @ q[0] - 1e-9 * (1 + np.abs(keys @ q[0])))


@given(st.integers(1, 40), st.integers(0, 700), st.integers(0, 3), st.integers(1, 3), st.data())
def test_select_pages_contract(n, budget, sinks, recent, data):
    scores = np.asarray(data.draw(st.lists(st.floats(-5, 5), min_size=n, max_size=n)))
    keep = select_pages(scores, budget, 16, sinks, recent)
    idx = np.arange(n)
    forced = (idx < sinks) | (idx >= n - recent)
    assert keep[forced].all()
    if budget <= 0 or max(budget // 16, forced.sum()) >= n:
        assert keep.all()
        return
    assert keep.sum() == max(budget // 16, forced.sum())
    dropped, kept_free = scores[~keep], scores[keep & ~forced]
    if dropped.size and kept_free.size:
        assert kept_free.min() >= dropped.max()
