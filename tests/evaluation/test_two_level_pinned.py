"""The evaluation's two-level selection (torch, all positions at once) equals the op's rule
(``tinyserve_trt.ops.two_level.select_sub_pages``) on the same inputs, so the quality numbers the
evaluation reports are those of the op's definition. Both get exact sub-page min/max here; the op
itself reads them 4-bit outward-rounded (``ops/fine_bounds.py``), which only loosens the bound.
The evaluation's ``candidates`` (a multiple of the budget) is not an op attribute: it is 1 here."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tinyserve_dev.evaluation.decode_attention import (  # noqa: E402
    SelectionSpec, page_min_max, page_scores, select_sub_pages)
from tinyserve_trt.ops import two_level  # noqa: E402
from tinyserve_trt.ops.policies import get_policy, reduce_group  # noqa: E402

HKV, G, D = 2, 3, 16


def _spec(rng, ps, sp):
    return SelectionSpec("query_aware", budget=int(rng.choice([sp, ps, 3 * ps + sp, 6 * ps])), page_size=ps,
                         sub_page_size=sp, candidates=1.0, candidate_share=float(rng.choice([0.0, 0.25, 0.5, 1.0])),
                         sink_pages=int(rng.integers(0, 3)), recent_pages=int(rng.integers(1, 3)),
                         group_reduce=str(rng.choice(["max", "sum"])))


@pytest.mark.parametrize("ps,sp", [(16, 4), (8, 2), (16, 8), (32, 4)])
def test_evaluation_two_level_equals_the_op_rule(rng, ps, sp):
    n_pages = 14
    T = n_pages * ps
    k = rng.standard_normal((HKV, T, D)) * (1 + 4 * (rng.random(D) < 0.15))
    positions = np.sort(rng.choice(np.arange(1, T), 24, replace=False))
    q = rng.standard_normal((HKV, G, positions.size, D))
    kmin, kmax = page_min_max(torch.from_numpy(k), ps)  # [Hkv, NP, D]; partial pages are forced anyway
    smin, smax = page_min_max(torch.from_numpy(k), sp)  # exact sub-page bounds [Hkv, NP*r, D]
    policy = get_policy("query_aware")
    for _ in range(6):
        spec = _spec(rng, ps, sp)
        tq = torch.from_numpy(q)
        scores = page_scores(spec, tq, kmin, kmax)
        got = select_sub_pages(spec, torch.from_numpy(positions), tq, torch.from_numpy(k), scores).numpy()
        for c, t in enumerate(positions):
            n = -(-int(t) // ps)
            for h in range(HKV):
                coarse = reduce_group(policy.score_ref(q[h, :, c], kmin[h, :n].numpy(), kmax[h, :n].numpy(),
                                                       None, None, ps, 1.0), spec.group_reduce)
                fine = reduce_group(policy.score_ref(q[h, :, c], smin[h, :n * ps // sp].numpy(),
                                                     smax[h, :n * ps // sp].numpy(), None, None, sp, 1.0),
                                    spec.group_reduce)
                want = two_level.select_sub_pages(coarse, fine, int(t), spec.budget, ps, sp, spec.candidate_share,
                                                  spec.sink_pages, spec.recent_pages)
                have = got[h, c, :n * ps // sp]
                assert not got[h, c, n * ps // sp:].any()
                assert have.sum() == want.sum(), (spec, t, h)
                np.testing.assert_allclose(np.sort(fine[have]), np.sort(fine[want]), rtol=1e-12, atol=1e-12,
                                           err_msg=f"{spec} step {t} head {h}")


def test_a_different_rule_is_caught(rng):
    """The comparison is not vacuous: a candidate share the evaluation does not use changes choices
    (budget 96 = 24 sub-pages, 8 of them forced; share 0 leaves 4 candidate pages for the other 16)."""
    ps, sp, n_pages = 16, 4, 30
    k = rng.standard_normal((HKV, n_pages * ps, D))
    q = rng.standard_normal((HKV, G, 1, D))
    spec = SelectionSpec("query_aware", budget=96, page_size=ps, sub_page_size=sp, candidates=1.0, candidate_share=0.0)
    kmin, kmax = page_min_max(torch.from_numpy(k), ps)
    smin, smax = page_min_max(torch.from_numpy(k), sp)
    t = n_pages * ps - 3
    got = select_sub_pages(spec, torch.tensor([t]), torch.from_numpy(q), torch.from_numpy(k),
                           page_scores(spec, torch.from_numpy(q), kmin, kmax)).numpy()
    policy = get_policy("query_aware")
    differs = 0
    for h in range(HKV):
        coarse = policy.score_ref(q[h, :, 0], kmin[h].numpy(), kmax[h].numpy(), None, None, ps, 1.0).max(0)
        fine = policy.score_ref(q[h, :, 0], smin[h].numpy(), smax[h].numpy(), None, None, sp, 1.0).max(0)
        same = two_level.select_sub_pages(coarse, fine, t, 96, ps, sp, 0.0, 1, 1)
        wider = two_level.select_sub_pages(coarse, fine, t, 96, ps, sp, 1.0, 1, 1)  # all pages candidates
        assert np.array_equal(got[h, 0], same)
        differs += not np.array_equal(got[h, 0], wider)
    assert differs
