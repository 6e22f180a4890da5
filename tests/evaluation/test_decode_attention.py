"""The all-positions harness against the op's numpy reference run as real decode steps."""

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tinyserve_trt.ops import policies, schema, sparse_attention_ref  # noqa: E402
from tinyserve_trt.ops.fine_bounds import page_sub_bounds  # noqa: E402
from tinyserve_trt.ops.reference import page_min_max  # noqa: E402
from tinyserve_dev.evaluation.decode_attention import (  # noqa: E402
    SelectionSpec, decode_attention, page_mass, page_scores, select_pages)

H, HKV, D, PS, T = 4, 2, 16, 8, 75


def random_qkv(rng):
    scale = 1 + 4 * (rng.random(D) < 0.15)  # outlier channels, as real keys have
    q = rng.standard_normal((H, T, D))
    k = rng.standard_normal((HKV, T, D)) * scale
    k[:, 0] += 3.0  # a sink-like first key
    v = rng.standard_normal((HKV, T, D))
    return q, k, v


def decode_step_case(q, k, v, t, budget, rng):
    """Op inputs of the decode step at past_len t: tokens < t in shuffled pages, exact min/max."""
    hkv, _, d = k.shape
    n = -(-t // PS)
    P = n + 2
    ids = rng.permutation(P)[:n]
    key_cache = rng.standard_normal((P, hkv, PS, d))  # unused slots hold garbage
    value_cache = rng.standard_normal((P, hkv, PS, d))
    key_min = rng.standard_normal((P, hkv, d))
    key_max = key_min.copy()
    for i, pid in enumerate(ids):
        valid = min(PS, t - i * PS)
        key_cache[pid, :, :valid] = k[:, i * PS:i * PS + valid]
        value_cache[pid, :, :valid] = v[:, i * PS:i * PS + valid]
        for h in range(hkv):
            key_min[pid, h], key_max[pid, h] = page_min_max(key_cache[pid, h], valid)
    page_table = np.zeros((1, max(n, 1) + 1), dtype=np.int32)
    page_table[0, :n] = ids
    return dict(query=q[None, :, t:t + 1], key=k[None, :, t:t + 1], value=v[None, :, t:t + 1],
                key_cache=key_cache, value_cache=value_cache, key_min=key_min, key_max=key_max,
                page_table=page_table, past_lens=np.array([t], dtype=np.int32),
                token_budget=np.array([budget], dtype=np.int32))


def step_budget(spec, t):
    if spec.page_fraction is None:
        return spec.budget
    return int(np.floor(spec.page_fraction * -(-t // PS))) * PS


SPECS = [
    SelectionSpec("query_aware", budget=24, page_size=PS),
    SelectionSpec("query_aware", budget=20, page_size=PS, group_reduce="sum"),  # not a page multiple
    SelectionSpec("query_aware", budget=32, page_size=PS, sink_pages=0, recent_pages=2),
    SelectionSpec("query_aware", page_size=PS, page_fraction=0.3),
    SelectionSpec("window", budget=24, page_size=PS, sink_pages=2),
    SelectionSpec("oracle", budget=24, page_size=PS),
    SelectionSpec("oracle", budget=16, page_size=PS, group_reduce="sum"),
    SelectionSpec("dense", budget=0, page_size=PS),
    SelectionSpec("query_aware", budget=0, page_size=PS),  # budget 0 is dense
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.label()}-{s.group_reduce}-s{s.sink_pages}r{s.recent_pages}")
def test_every_row_equals_reference_decode_step(rng, spec):
    q, k, v = random_qkv(rng)
    scale = D ** -0.5
    out = decode_attention(torch.tensor(q), torch.tensor(k), torch.tensor(v), 0, spec, scale, chunk=16)
    kmin, kmax = (torch.tensor(x) for x in _minmax(k))
    attrs = schema.OpAttributes(policy=spec.policy, sink_pages=spec.sink_pages, recent_pages=spec.recent_pages,
                                group_reduce=spec.group_reduce)
    for t in range(T):
        case = decode_step_case(q, k, v, t, step_budget(spec, t), rng)
        ref, ref_sel = sparse_attention_ref(**case, attrs=attrs)
        np.testing.assert_allclose(out[:, t].numpy(), ref[0, :, 0], atol=1e-5, rtol=1e-5, err_msg=f"t={t}")
        if t == 0:
            continue
        n, n_all = -(-t // PS), -(-(t + 1) // PS)
        qc = torch.tensor(q[:, t:t + 1]).view(HKV, H // HKV, 1, D)
        mass = page_mass(_dense_probs(q, k, t, scale), PS, n_all)
        if spec.is_dense:
            continue
        keep = select_pages(spec, torch.tensor([t]), page_scores(spec, qc, kmin[:, :n_all], kmax[:, :n_all], mass))
        assert keep[:, 0, :n].numpy().tolist() == ref_sel[0, :, :n].tolist(), f"t={t}"


@pytest.mark.parametrize("name", policies.registered())
def test_torch_score_is_the_policy_reference_score(rng, name):
    """The harness scores through the registry's policy object; its torch form must be
    the numpy reference's score for every head and position (one definition per policy)."""
    policy = policies.get_policy(name)
    q, k, _ = random_qkv(rng)
    scale = D ** -0.5
    kmin, kmax = _minmax(k)
    G = H // HKV
    for t in (8, 33, 74):
        n = -(-t // PS)
        qc = torch.tensor(q[:, t:t + 1]).view(HKV, G, 1, D)
        mass = page_mass(_dense_probs(q, k, t, scale), PS, n)
        got = policy.score_torch(qc, torch.tensor(kmin[:, :n]), torch.tensor(kmax[:, :n]), mass)
        assert got.shape == (HKV, G, 1, n)
        # the harness's mass also counts the token's own probability, in its own page (forced,
        # so never a choice): compare an oracle on the pages before it
        m = t // PS if policy.reads_attention_mass else n
        for h in range(HKV):
            want = policy.score_ref(q[h * G:(h + 1) * G, t], kmin[h, :n], kmax[h, :n], k[h, :t], k[h, t], PS, scale)
            np.testing.assert_allclose(got[h, :, 0, :m].numpy(), want[:, :m], rtol=1e-9, atol=1e-12,
                                       err_msg=f"t={t} h={h}")


def test_chunks_and_offset_do_not_change_rows(rng):
    q, k, v = (torch.tensor(x) for x in random_qkv(rng))
    spec = SelectionSpec("query_aware", budget=24, page_size=PS)
    whole = decode_attention(q, k, v, 0, spec, 0.25, chunk=T)
    tail = decode_attention(q[:, 40:], k, v, 40, spec, 0.25, chunk=7)
    torch.testing.assert_close(tail, whole[:, 40:], atol=1e-6, rtol=1e-6)


def test_sparse_rows_differ_from_dense(rng):
    """Guard against a budget that is silently ignored."""
    q, k, v = (torch.tensor(x) for x in random_qkv(rng))
    dense = decode_attention(q, k, v, 0, SelectionSpec("dense", budget=0, page_size=PS), 0.25)
    sparse = decode_attention(q, k, v, 0, SelectionSpec("query_aware", budget=16, page_size=PS), 0.25)
    assert torch.equal(dense[:, :17], sparse[:, :17])  # up to 2 pages in the cache: all kept
    assert (dense[:, 40:] - sparse[:, 40:]).abs().max() > 1e-3


def _minmax(k):
    n = -(-T // PS)
    kmin = np.zeros((HKV, n, D))
    kmax = np.zeros((HKV, n, D))
    for j in range(n):
        kmin[:, j] = k[:, j * PS:(j + 1) * PS].min(1)
        kmax[:, j] = k[:, j * PS:(j + 1) * PS].max(1)
    return kmin, kmax


def _dense_probs(q, k, t, scale):
    """Causal softmax of the query at t over keys 0..t: [Hkv, G, 1, t + 1]."""
    qg = torch.tensor(q[:, t]).view(HKV, H // HKV, 1, D)
    logits = qg @ torch.tensor(k[:, None, :t + 1]).transpose(-1, -2) * scale
    return torch.softmax(logits, -1)


def test_spec_validation():
    with pytest.raises(ValueError):
        SelectionSpec("nope")
    with pytest.raises(ValueError):
        SelectionSpec(budget=-1)
    with pytest.raises(ValueError):
        SelectionSpec(page_fraction=0.0)


def _with_sub_bounds(case, sp):
    """The step's ``key_sub_bounds``: 4-bit codes of every page's valid keys (``ops.fine_bounds``)."""
    kc, t = case["key_cache"], int(case["past_lens"][0])
    sub = np.zeros((kc.shape[0], kc.shape[1], PS // sp, kc.shape[3]), np.uint8)
    for i, pid in enumerate(case["page_table"][0, :-(-t // PS)]):
        sub[pid] = page_sub_bounds(kc[pid], sp, case["key_min"][pid], case["key_max"][pid], min(PS, t - i * PS))
    return dict(case, key_sub_bounds=sub)


@pytest.mark.parametrize("spec", [
    SelectionSpec("query_aware", budget=16, page_size=PS, sub_page_size=2),
    SelectionSpec("query_aware", budget=12, page_size=PS, sub_page_size=4, candidate_share=0.25, sink_pages=0),
    SelectionSpec("query_aware", budget=16, page_size=PS, sub_page_size=2, candidate_share=1.0, recent_pages=2),
    SelectionSpec("query_aware", budget=8, page_size=PS, sub_page_size=2, candidate_share=0.0,
                  group_reduce="sum"),
], ids=["share50", "share25-nosink", "all-candidates", "share0-sum"])
def test_two_level_rows_equal_reference_decode_steps(rng, spec):
    """Two-level rows are the op's: its numpy reference run as a real decode step, fed the 4-bit
    ``key_sub_bounds`` the runtime stores - so quality numbers measure what the op does."""
    q, k, v = random_qkv(rng)
    q_start = 20
    got = decode_attention(torch.from_numpy(q[:, q_start:]), torch.from_numpy(k), torch.from_numpy(v), q_start,
                           spec, D ** -0.5, chunk=16).numpy()
    attrs = schema.OpAttributes(policy=spec.policy, sink_pages=spec.sink_pages, recent_pages=spec.recent_pages,
                                group_reduce=spec.group_reduce, sub_page_size=spec.sub_page_size,
                                candidate_share=spec.candidate_share)
    sparse_rows = 0
    for t in range(q_start, T):
        case = _with_sub_bounds(decode_step_case(q, k, v, t, spec.budget, rng), spec.sub_page_size)
        ref, sel = sparse_attention_ref(**case, attrs=attrs)
        np.testing.assert_allclose(got[:, t - q_start], ref[0, :, 0], rtol=1e-9, atol=1e-9, err_msg=f"step {t}")
        sparse_rows += not sel[0, :, :-(-t // PS)].all()
    assert sparse_rows  # some steps really select


def test_two_level_rows_differ_from_single_level(rng):
    """Not vacuous: re-ranking sub-pages changes rows that single-level selection gives."""
    q, k, v = random_qkv(rng)
    args = (torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), 0)
    one = decode_attention(*args, SelectionSpec("query_aware", budget=16, page_size=PS), D ** -0.5)
    two = decode_attention(*args, SelectionSpec("query_aware", budget=16, page_size=PS, sub_page_size=2), D ** -0.5)
    assert not torch.allclose(one, two)


def test_two_level_spec_validation():
    with pytest.raises(ValueError, match="sub_page_size"):
        SelectionSpec("query_aware", budget=16, page_size=8, sub_page_size=3)
    with pytest.raises(ValueError, match="sub_page_size"):
        SelectionSpec("query_aware", budget=16, page_size=8, sub_page_size=16)
    with pytest.raises(ValueError, match="sub_page_size"):
        SelectionSpec("window", budget=16, page_size=8, sub_page_size=4)
    with pytest.raises(ValueError, match="candidate_share"):
        SelectionSpec("query_aware", budget=16, page_size=8, sub_page_size=4, candidate_share=1.5)


def test_reuse_steps_rows_attend_the_anchor_selection(rng):
    """LServe-style reuse (``reuse_steps=2``): a step at an even offset from the first decode step
    selects as usual; the next one attends that selection plus its own forced and own pages."""
    q, k, v = (torch.tensor(x) for x in random_qkv(rng))
    base = SelectionSpec("query_aware", budget=24, page_size=PS)
    start, scale = 33, 0.25
    plain = decode_attention(q[:, start:], k, v, start, base, scale)
    reused = decode_attention(q[:, start:], k, v, start, SelectionSpec("query_aware", budget=24, page_size=PS,
                                                                       reuse_steps=2), scale)
    torch.testing.assert_close(reused[:, 0::2], plain[:, 0::2], atol=1e-6, rtol=1e-6)  # anchors: unchanged
    assert (reused[:, 1::2] - plain[:, 1::2]).abs().max() > 1e-3  # reuse is not silently ignored
    n = -(-T // PS)
    kmin = torch.tensor(_minmax(k.numpy())[0])
    kmax = torch.tensor(_minmax(k.numpy())[1])
    G = H // HKV
    for t in range(start + 1, T, 2):  # each reusing row by hand: the anchor t-1's pages, t's forced, t's own
        qa = (q[:, t - 1] * scale).view(HKV, G, 1, D)
        keep = select_pages(base, torch.tensor([t - 1]), page_scores(base, qa, kmin[:, :n], kmax[:, :n]))[:, 0]
        pages_t = -(-t // PS)
        keep = keep.clone()
        keep[:, 0] = True  # sink
        keep[:, pages_t - 1] = True  # recent
        keep[:, t // PS] = True  # own page
        allowed = keep.repeat_interleave(PS, dim=-1)[:, :t + 1]  # [Hkv, t + 1]
        logits = (q[:, t].view(HKV, G, D) @ k[:, :t + 1].transpose(1, 2)) * scale
        logits = logits.masked_fill(~allowed[:, None, :], float("-inf"))
        want = (torch.softmax(logits, -1) @ v[:, :t + 1]).reshape(H, D)
        torch.testing.assert_close(reused[:, t - start], want, atol=1e-6, rtol=1e-6)


KV_HEAD_INPUTS = ("key", "value", "key_cache", "value_cache", "key_min", "key_max", "key_sub_bounds")  # axis 1
GROUP_SPECS = [
    SelectionSpec("query_aware", budget=16, page_size=PS, sub_page_size=2, candidate_share=1.0),
    SelectionSpec("query_aware", budget=12, page_size=PS, sub_page_size=4, sink_pages=0),
    SelectionSpec("query_aware", budget=24, page_size=PS),
]


@pytest.mark.parametrize("spec", GROUP_SPECS, ids=["all-candidates", "share50-nosink", "single-level"])
def test_head_selection_rows_are_each_query_head_alone(rng, spec):
    """``group_select="head"``: every query head's rows are the op's reference decode steps with that
    head alone in its group (GQA as MHA), on the same cache - and they differ from the shared rows."""
    q, k, v = random_qkv(rng)
    q_start, G = 20, H // HKV
    args = (torch.from_numpy(q[:, q_start:]), torch.from_numpy(k), torch.from_numpy(v), q_start)
    got = decode_attention(*args, replace(spec, group_select="head"), D ** -0.5, chunk=16).numpy()
    shared = decode_attention(*args, spec, D ** -0.5, chunk=16).numpy()
    attrs = schema.OpAttributes(policy=spec.policy, sink_pages=spec.sink_pages, recent_pages=spec.recent_pages,
                                sub_page_size=spec.sub_page_size, candidate_share=spec.candidate_share)
    for t in range(q_start, T):
        case = decode_step_case(q, k, v, t, spec.budget, rng)
        if spec.sub_page_size:
            case = _with_sub_bounds(case, spec.sub_page_size)
        for h in range(H):
            alone = dict(case, query=case["query"][:, h:h + 1], **{  # KV inputs: the head's KV head
                name: case[name][:, h // G:h // G + 1] for name in KV_HEAD_INPUTS if name in case})
            ref, _ = sparse_attention_ref(**alone, attrs=attrs)
            np.testing.assert_allclose(got[h, t - q_start], ref[0, 0, 0], rtol=1e-9, atol=1e-9,
                                       err_msg=f"step {t} head {h}")
    assert np.abs(got - shared).max() > 1e-3  # heads really choose differently from their group


def test_union_selection_attends_the_group_union_of_head_choices(rng):
    """``group_select="union"``: each head attends the union of its group's per-head choices (each the
    op's reference ``decode_keep`` with one query head), computed here by hand."""
    from tinyserve_trt.ops.reference import decode_keep

    spec = SelectionSpec("query_aware", budget=16, page_size=PS, sub_page_size=2, candidate_share=0.5)
    q, k, v = random_qkv(rng)
    q_start, G, sp, scale = 20, H // HKV, 2, D ** -0.5
    got = decode_attention(torch.from_numpy(q[:, q_start:]), torch.from_numpy(k), torch.from_numpy(v), q_start,
                           replace(spec, group_select="union"), scale, chunk=16).numpy()
    attrs = schema.OpAttributes(policy=spec.policy, sub_page_size=sp, candidate_share=spec.candidate_share)
    wider = 0
    for t in range(q_start, T):
        case = _with_sub_bounds(decode_step_case(q, k, v, t, spec.budget, rng), sp)
        ids = case["page_table"][0, :-(-t // PS)]
        for h in range(HKV):
            keeps = [decode_keep(q[h * G + g, t][None], case["key_min"][ids, h], case["key_max"][ids, h], k[h, :t],
                                 k[h, t], t, spec.budget, PS, attrs, scale, case["key_sub_bounds"][ids, h])
                     for g in range(G)]
            union = np.logical_or.reduce(keeps)
            wider += union.sum() > max(x.sum() for x in keeps)
            allowed = np.append(np.repeat(union, sp)[:t], True)  # plus the token itself
            for g in range(G):
                logits = k[h, :t + 1][allowed] @ q[h * G + g, t] * scale
                p = np.exp(logits - logits.max())
                np.testing.assert_allclose(got[h * G + g, t - q_start], (p / p.sum()) @ v[h, :t + 1][allowed],
                                           rtol=1e-9, atol=1e-9, err_msg=f"step {t} head {h * G + g}")
    assert wider  # the union is larger than any one head's choice somewhere


def test_group_select_is_validated_and_labelled():
    with pytest.raises(ValueError, match="group_select"):
        SelectionSpec("query_aware", budget=16, page_size=8, group_select="each")
    assert SelectionSpec("query_aware", budget=16, page_size=8, group_select="head").label() == "query_aware/head@16"
