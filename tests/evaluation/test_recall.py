"""Attention-mass recall against brute force: the dense mass on the tokens the op's reference attends."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tinyserve_trt.ops import schema, sparse_attention_ref  # noqa: E402
from tinyserve_dev.evaluation.decode_attention import (  # noqa: E402
    SelectionSpec, decode_attention, page_mass, page_min_max, page_scores, sub_page_bounds)
from tinyserve_dev.evaluation.recall import RecallProbe, step_recall, step_recall_two_level  # noqa: E402
from tests.evaluation.test_decode_attention import (  # noqa: E402
    H, HKV, PS, T, _dense_probs, _minmax, _with_sub_bounds, decode_step_case, random_qkv, step_budget)

D = 16
G = H // HKV
WIDE = T + 5  # head dim of the brute-force cases: one-hot values, one channel per token


@pytest.mark.parametrize("spec", [SelectionSpec("query_aware", budget=24, page_size=PS),
                                  SelectionSpec("oracle", page_size=PS, page_fraction=0.5),
                                  SelectionSpec("window", budget=16, page_size=PS)], ids=SelectionSpec.label)
def test_recall_is_dense_mass_on_reference_selection(rng, spec):
    q, k, v = random_qkv(rng)
    scale = D ** -0.5
    kmin, kmax = (torch.tensor(x) for x in _minmax(k))
    attrs = schema.OpAttributes(policy=spec.policy, sink_pages=spec.sink_pages, recent_pages=spec.recent_pages)
    for t in (1, 8, 9, 33, 64, 74):
        n_all = -(-(t + 1) // PS)
        probs = _dense_probs(q, k, t, scale)  # [Hkv, G, 1, t + 1]
        qc = torch.tensor(q[:, t:t + 1]).view(HKV, G, 1, D)
        mass = page_mass(probs, PS, n_all)
        scores = page_scores(spec, qc, kmin[:, :n_all], kmax[:, :n_all], mass)
        got = step_recall(spec, torch.tensor([t]), scores, mass)
        _, sel = sparse_attention_ref(**decode_step_case(q, k, v, t, step_budget(spec, t), rng), attrs=attrs)
        n = -(-t // PS)
        kept_tok = np.append(np.repeat(sel[0, :, :n], PS, axis=1)[:, :t], np.ones((HKV, 1), bool), axis=1)
        want = (probs[:, :, 0].numpy() * kept_tok[:, None]).sum(-1)
        np.testing.assert_allclose(got[:, :, 0].numpy(), want, atol=1e-9, err_msg=f"t={t}")


def _wide_qkv(rng):
    """q, k of head dim WIDE (outlier channels, a sink-like first key) and one-hot values: token j's
    value is e_j, so the reference's output row for a query IS its sparse attention over tokens."""
    scale = 1 + 4 * (rng.random(WIDE) < 0.15)
    q = rng.standard_normal((H, T, WIDE))
    k = rng.standard_normal((HKV, T, WIDE)) * scale
    k[:, 0] += 3.0
    v = np.broadcast_to(np.eye(T, WIDE), (HKV, T, WIDE)).copy()
    return q, k, v


def _brute_force_recall(q, k, v, spec, t, rng):
    """``[Hkv, G]`` dense mass on the tokens the op's numpy reference attends at decode step ``t``,
    token by token: the tokens are those with a nonzero weight in the reference's output."""
    attrs = schema.OpAttributes(policy=spec.policy, sink_pages=spec.sink_pages, recent_pages=spec.recent_pages,
                                group_reduce=spec.group_reduce, sub_page_size=spec.sub_page_size,
                                candidate_share=spec.candidate_share)
    case = decode_step_case(q, k, v, t, step_budget(spec, t), rng)
    out, _ = sparse_attention_ref(**_with_sub_bounds(case, spec.sub_page_size), attrs=attrs)
    scale = WIDE ** -0.5
    got = np.zeros((HKV, G))
    for h in range(HKV):
        for g in range(G):
            logits = k[h, :t + 1] @ q[h * G + g, t] * scale
            dense = np.exp(logits - logits.max())
            dense /= dense.sum()
            attended = out[0, h * G + g, 0, :t + 1] > 0
            assert attended[t] and not out[0, h * G + g, 0, t + 1:].any()
            got[h, g] = dense[attended].sum()
    return got


TWO_LEVEL = [
    SelectionSpec("query_aware", page_size=PS, page_fraction=0.3, sub_page_size=2),
    SelectionSpec("query_aware", page_size=PS, page_fraction=0.5, sub_page_size=4, candidate_share=0.75,
                  group_reduce="sum"),
    SelectionSpec("query_aware", budget=20, page_size=PS, sub_page_size=2, sink_pages=0, recent_pages=2),
]


@pytest.mark.parametrize("spec", TWO_LEVEL, ids=SelectionSpec.label)
def test_two_level_recall_is_brute_force_kept_mass(rng, spec):
    """Per step and head, and through the probe fed by ``decode_attention``: the two-level recall is
    the dense mass on exactly the tokens the op's reference attends at the step's token budget."""
    q, k, v = _wide_qkv(rng)
    want = np.stack([_brute_force_recall(q, k, v, spec, t, rng) for t in range(T)], axis=-1)  # [Hkv, G, T]
    assert (want[..., PS:] < 1 - 1e-6).any()  # some steps really leave mass out
    kt = torch.from_numpy(k)
    kmin, kmax = page_min_max(kt, PS)
    lo, hi = sub_page_bounds(kt, spec, kmin, kmax)
    for t in range(1, T):
        n_all = -(-(t + 1) // PS)
        probs = torch.nn.functional.pad(_dense_probs_wide(q, k, t), (0, n_all * PS - t - 1))
        qc = torch.from_numpy(q[:, t:t + 1]).reshape(HKV, G, 1, WIDE)
        got = step_recall_two_level(spec, torch.tensor([t]), qc, kmin[:, :n_all], kmax[:, :n_all], lo, hi, probs)
        np.testing.assert_allclose(got[:, :, 0].numpy(), want[:, :, t], atol=1e-9, err_msg=f"t={t}")
    probe = RecallProbe([spec])
    decode_attention(torch.from_numpy(q), kt, torch.from_numpy(v), 0, SelectionSpec("dense", budget=0),
                     WIDE ** -0.5, chunk=16, probe=probe)
    assert probe.mean(spec.label()) == pytest.approx(want.mean(), abs=1e-9)


def _dense_probs_wide(q, k, t):
    logits = torch.from_numpy(q[:, t]).reshape(HKV, G, 1, WIDE) @ torch.from_numpy(k[:, None, :t + 1]).transpose(-1, -2)
    return torch.softmax(logits * WIDE ** -0.5, -1)


@pytest.mark.parametrize("fraction,reduce", [(0.3, "max"), (0.5, "sum"), (0.2, "max")])
def test_two_level_with_whole_pages_is_single_level(rng, fraction, reduce):
    """``sub_page_size == page_size`` selects as single level (as in the op): the same recall; and a
    smaller sub-page, among more candidate pages than the budget's, gives another (the probe really
    runs the two-level rule)."""
    q, k, v = (torch.from_numpy(x.astype(np.float32)) for x in random_qkv(rng))
    one, whole, two = (SelectionSpec("query_aware", page_size=PS, page_fraction=fraction, group_reduce=reduce,
                                     sub_page_size=sp, candidate_share=0.75) for sp in (0, PS, 2))
    probe = RecallProbe([one, whole, two])
    decode_attention(q, k, v, 0, SelectionSpec("dense", budget=0), D ** -0.5, chunk=16, probe=probe)
    assert probe.mean(whole.label()) == pytest.approx(probe.mean(one.label()), abs=1e-12)
    assert probe.mean(two.label()) != pytest.approx(probe.mean(one.label()), abs=1e-6)


def test_probe_labels_must_differ():
    spec = SelectionSpec("query_aware", page_size=PS, page_fraction=0.3)
    with pytest.raises(ValueError, match="distinct labels"):
        RecallProbe([spec, spec])
