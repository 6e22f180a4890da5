"""HotnessPolicy: sinks and recent pages never demoted, the budget respected, decay."""

import numpy as np
import pytest

from tinyserve_trt.runtime.config import CacheConfig
from tinyserve_trt.runtime.tiers.hotness import HotnessConfig, HotnessPolicy
from tinyserve_trt.runtime.tiers import TierConfig, TieredPagePool

PS = 4


def pool_with_sequences(lens, hot=32, cold=32):
    pool = TieredPagePool(CacheConfig(page_size=PS, num_pages=hot, dtype="float32"),
                          TierConfig(num_cold_pages=cold), 2, 1, 4)
    rng = np.random.default_rng(0)
    seqs = []
    for n in lens:
        pages = pool.allocate(-(-n // PS))
        for j, p in enumerate(pages):
            m = min(PS, n - j * PS)
            for layer in range(2):
                k = rng.standard_normal((m, 1, 4)).astype(np.float32)
                pool.write_tokens(layer, p * PS + np.arange(m), k, k)
        seqs.append(pages)
    return pool, seqs


def test_config_validation():
    with pytest.raises(ValueError, match="decay"):
        HotnessConfig(decay=0.0)
    with pytest.raises(ValueError, match="recent_pages"):
        HotnessConfig(recent_pages=0)
    with pytest.raises(ValueError, match="hot_fraction or max_hot_pages"):
        HotnessConfig(hot_fraction=None)
    with pytest.raises(ValueError, match="hot_fraction"):
        HotnessConfig(hot_fraction=1.5)


def test_sinks_and_recent_never_demoted_even_over_budget():
    pool, seqs = pool_with_sequences([30, 13])  # 8 + 4 pages; the 13-token one ends partial
    policy = HotnessPolicy(HotnessConfig(sink_pages=1, recent_pages=2, hot_fraction=0.0), pool.num_pages)
    demoted = policy.rebalance(pool, seqs)
    keep = {seqs[0][0], *seqs[0][-2:], seqs[1][0], *seqs[1][-2:]}
    assert not keep & set(demoted)
    assert set(pool.hot_pages()) == keep  # everything else went cold
    pool.check_integrity(seqs, check_data=True)


def test_budget_respected_and_least_hit_demoted_first():
    pool, seqs = pool_with_sequences([40])  # 10 full pages
    policy = HotnessPolicy(HotnessConfig(sink_pages=1, recent_pages=1, hot_fraction=None, max_hot_pages=6),
                           pool.num_pages)
    pages = seqs[0]
    sel = np.zeros((3, 1, 1, 12), bool)  # 3 layers, 1 row, Hkv 1, NP 12
    sel[:, 0, 0, [2, 5, 7]] = True
    table = np.array([pages + [pages[0]] * 2])
    policy.observe(sel, table, np.array([10]))
    assert policy.hits[pages[2]] == 3 and policy.hits[pages[3]] == 0
    demoted = policy.rebalance(pool, seqs)
    assert len(pool.hot_pages()) == 6 and len(demoted) == 4
    assert set(demoted) == {pages[1], pages[3], pages[4], pages[6]}  # unhit, not sink/recent, lowest ids
    assert policy.rebalance(pool, seqs) == []  # budget met: nothing more
    pool.check_integrity(seqs, check_data=True)


def test_padding_columns_are_not_counted():
    policy = HotnessPolicy(HotnessConfig(), 8)
    sel = np.ones((1, 2, 3), bool)
    policy.observe(sel, np.array([[5, 0, 0]]), np.array([1]))
    assert policy.hits[5] == 2 and policy.hits[0] == 0  # one page in use, 2 KV heads


def test_decay_and_shared_pages():
    policy = HotnessPolicy(HotnessConfig(decay=0.5), 8)
    table = np.array([[3, 4], [3, 6]])  # page 3 is a shared prefix page
    sel = np.zeros((2, 1, 2), bool)
    sel[:, 0, 0] = True
    policy.observe(sel, table, np.array([2, 2]))
    assert policy.hits[3] == 2  # counted from both sequences
    policy.observe(np.zeros_like(sel), table, np.array([2, 2]))
    policy.observe(np.zeros_like(sel), table, np.array([2, 2]))
    assert policy.hits[3] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="does not match"):
        policy.observe(np.zeros((1, 1, 2), bool), table, np.array([2, 2]))


def test_freed_pages_lose_their_history():
    pool, seqs = pool_with_sequences([8])
    policy = HotnessPolicy(HotnessConfig(hot_fraction=1.0), pool.num_pages)
    policy.hits[seqs[0]] = 5.0
    pool.decref(seqs[0][1])
    policy.plan(pool, [seqs[0][:1]])
    assert policy.hits[seqs[0][1]] == 0 and policy.hits[seqs[0][0]] == 5


def test_engine_loop_shape_with_a_small_hot_tier():
    """schedule -> model writes -> observe selections -> rebalance, as the engine will run it:
    a hot tier too small for the live context keeps running because full pages go cold."""
    from tinyserve_trt.runtime.config import SchedulerConfig
    from tinyserve_trt.runtime.sampling import SampleOutput, SamplingParams
    from tinyserve_trt.runtime.scheduler import Scheduler

    from tests.runtime.fakes import run_model

    rng = np.random.default_rng(5)
    pool = TieredPagePool(CacheConfig(page_size=PS, num_pages=16, dtype="float32"), TierConfig(num_cold_pages=48),
                          1, 1, 4)
    sched = Scheduler(SchedulerConfig(max_batch=4, max_tokens_per_step=16, prefill_chunk=8), pool)
    policy = HotnessPolicy(HotnessConfig(sink_pages=1, recent_pages=2, max_hot_pages=10, hot_fraction=None),
                           pool.num_pages)
    for i in range(6):
        sched.add(f"r{i}", list(rng.integers(1, 50, 20)), SamplingParams(max_tokens=20, ignore_eos=True))
    steps, max_live = 0, 0
    while sched.has_unfinished():
        batch = sched.schedule()
        run_model(pool, batch)
        NP = batch.page_table.shape[1]
        policy.observe(rng.random((1, len(batch), 1, NP)) < 0.3, batch.page_table,
                       -(-batch.past_lens // PS))
        sched.postprocess(batch, SampleOutput(rng.integers(1, 50, len(batch))))
        policy.rebalance(pool, [s.pages for s in sched.running])
        sched.check_integrity()
        pool.check_integrity([s.pages for s in sched.running], check_data=True)
        max_live = max(max_live, len(pool.hot_pages()) + len(pool.cold_pages()))
        steps += 1
        assert steps < 2000
    assert max_live > pool.num_hot  # the live context did not fit the hot tier alone


def test_promotion_only_into_room_under_the_target_and_bounded():
    """Cold pages that become hot again (decayed hits) return when the hot count is below target,
    most hit first, at most max_promotions per step; integrity holds both ways."""
    pool, seqs = pool_with_sequences([40, 40])  # 10 full pages each
    cfg = HotnessConfig(hot_fraction=0.5, sink_pages=1, recent_pages=1, max_promotions=2, promote_hits=1.0)
    policy = HotnessPolicy(cfg, pool.num_pages)
    assert len(policy.rebalance(pool, seqs)) == 10 and len(pool.hot_pages()) == 10
    cold = pool.cold_pages()
    assert policy.plan_promotions(pool) == []  # at the target: no room
    for p in seqs[1]:  # the second sequence ends: its pages are freed, leaving room under the target
        pool.decref(p)
    pool.check_integrity([seqs[0]], check_data=True)
    live_cold = [p for p in cold if p in seqs[0]]
    table = np.array([seqs[0]])
    sel = np.zeros((1, 1, 1, len(seqs[0])), bool)
    hot_again = live_cold[:3]
    sel[..., [seqs[0].index(p) for p in hot_again]] = True
    policy.observe(sel, table, np.array([len(seqs[0])]))
    planned = policy.plan_promotions(pool)
    assert len(planned) == 2 and set(planned) <= set(hot_again)  # bounded by max_promotions, only hit pages
    assert policy.promote(pool) == planned and all(pool.is_hot(p) for p in planned)
    pool.check_integrity([seqs[0]], check_data=True)
    target = policy.target_hot(len(pool.hot_pages()) + len(pool.cold_pages()))
    for _ in range(5):
        policy.observe(sel, table, np.array([len(seqs[0])]))
        policy.promote(pool)
        assert len(pool.hot_pages()) <= max(target, 10)
    assert all(pool.is_hot(p) for p in hot_again)
    assert not any(pool.is_hot(p) for p in set(live_cold) - set(hot_again))  # never selected: stays cold
    pool.check_integrity([seqs[0]], check_data=True)
    with pytest.raises(ValueError, match="max_promotions"):
        HotnessConfig(max_promotions=-1)
    with pytest.raises(ValueError, match="promote_hits"):
        HotnessConfig(promote_hits=0)
