import numpy as np
import pytest

from tinyserve_trt.runtime.config import CacheConfig, SchedulerConfig
from tinyserve_trt.runtime.pages import PagePool
from tinyserve_trt.runtime.sampling import SamplingParams
from tinyserve_trt.runtime.scheduler import Scheduler
from tinyserve_trt.runtime.sequence import FinishReason, SequenceStatus

from tests.runtime.fakes import check_kv_contents, check_minmax, run_model, step


def make(num_pages=32, page_size=4, prefix_cache="hash", **sched):
    cfg = dict(max_batch=8, max_tokens_per_step=32, prefill_chunk=16)
    cfg.update(sched)
    pool = PagePool(CacheConfig(page_size=page_size, num_pages=num_pages, dtype="float32",
                                prefix_cache=prefix_cache), 2, 2, 3)
    return Scheduler(SchedulerConfig(**cfg), pool)


def drain(sched, rng, limit=10_000):
    finished = []
    for _ in range(limit):
        if not sched.has_unfinished():
            break
        finished += step(sched, rng)
        sched.check_integrity()
        check_kv_contents(sched)
    assert not sched.has_unfinished()
    return finished


def test_batch_arrays_match_contract():
    sched = make(prefill_chunk=6, max_tokens_per_step=8)
    sched.add("a", list(range(10)), SamplingParams(max_tokens=2))
    sched.add("b", [5, 6], SamplingParams(max_tokens=2, token_budget=64))
    b = sched.schedule()
    assert [s.request_id for s in b.seqs] == ["a", "b"]
    assert b.num_new_tokens.tolist() == [6, 2] and b.past_lens.tolist() == [0, 0]
    assert b.input_ids.shape == (2, 6) and b.input_ids[1].tolist() == [5, 6, 0, 0, 0, 0]
    assert b.page_table.dtype == np.int32 and b.page_table.shape == (2, 2)
    assert b.page_table[1, 1] == 0  # padding is a valid id
    assert (b.slot_mapping[1, 2:] == -1).all()
    assert b.sample_mask.tolist() == [False, True]
    assert b.token_budget.tolist() == [0, 0]  # prompt tokens attend densely; b's 64 applies at decode
    a_pages = sched.running[0].pages
    np.testing.assert_array_equal(b.slot_mapping[0], [a_pages[i // 4] * 4 + i % 4 for i in range(6)])
    run_model(sched.pool, b)
    sched.postprocess(b, np.array([-1, 3]))
    b = sched.schedule()  # decode and prefill never share a batch: b decodes (1) first ...
    assert [s.request_id for s in b.seqs] == ["b"]
    assert b.num_new_tokens.tolist() == [1] and b.past_lens.tolist() == [2]
    assert b.sample_mask.tolist() == [True] and b.token_budget.tolist() == [64]
    run_model(sched.pool, b)
    sched.postprocess(b, np.array([4]))
    b = sched.schedule()  # ... then a computes the rest of its prompt (4)
    assert [s.request_id for s in b.seqs] == ["a"]
    assert b.num_new_tokens.tolist() == [4] and b.past_lens.tolist() == [6]
    assert b.sample_mask.tolist() == [True] and b.token_budget.tolist() == [0]


def test_decode_and_prefill_steps_alternate():
    """A long chunked prefill neither stalls a running decode nor waits behind it."""
    sched = make(prefill_chunk=4, max_tokens_per_step=8)
    a = sched.add("a", [1, 2, 3], SamplingParams(max_tokens=12, ignore_eos=True))
    rng = np.random.default_rng(0)
    step(sched, rng)  # a's prompt
    sched.add("b", list(range(1, 29)), SamplingParams(max_tokens=1))  # 7 chunks of 4
    kinds = []
    while sched.has_unfinished():
        b = sched.schedule()
        kinds.append("wide" if (b.num_new_tokens > 1).any() else "narrow")
        run_model(sched.pool, b)
        sched.postprocess(b, rng.integers(0, 8, len(b)))
        sched.check_integrity()
    assert a.num_output_tokens == 12
    last_wide = max(i for i, k in enumerate(kinds) if k == "wide")
    both = kinds[:last_wide + 1]
    assert both.count("wide") == 7 and all(x != y for x, y in zip(both, both[1:]))  # strictly alternating while both are pending


def test_limits_respected():
    sched = make(max_batch=3, max_tokens_per_step=10, prefill_chunk=4)
    for i in range(6):
        sched.add(str(i), [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=3))
    rng = np.random.default_rng(0)
    while sched.has_unfinished():
        b = sched.schedule()
        assert len(b) <= 3 and b.num_tokens <= 10 and (b.num_new_tokens <= 4).all()
        assert len(set((b.num_new_tokens > 1).tolist())) <= 1  # decode rows never ride with prefill chunks
        run_model(sched.pool, b)
        sched.postprocess(b, rng.integers(0, 8, len(b)))
        sched.check_integrity()


def test_prefix_sharing_skips_prefill_and_reuses_pages():
    sched = make()
    rng = np.random.default_rng(1)
    prompt = list(range(1, 12))  # 11 tokens: two full pages of 4
    first = sched.add("a", prompt, SamplingParams(max_tokens=2))
    drain(sched, rng)
    assert first.stats.prefix_tokens_reused == 0
    assert sched.pool.num_evictable >= 2
    second = sched.add("b", prompt + [40, 41], SamplingParams(max_tokens=2))
    b = sched.schedule()
    assert second.stats.prefix_pages_reused == 2 and b.past_lens.tolist() == [8]
    assert b.num_new_tokens.tolist() == [5]
    run_model(sched.pool, b)
    sched.postprocess(b, np.array([0]))
    check_kv_contents(sched)  # reused pages hold the right K/V
    drain(sched, rng)


def test_sharing_off_recomputes():
    sched = make(prefix_cache="none")
    rng = np.random.default_rng(2)
    sched.add("a", list(range(12)), SamplingParams(max_tokens=1))
    drain(sched, rng)
    seq = sched.add("b", list(range(12)), SamplingParams(max_tokens=1))
    assert sched.schedule().past_lens.tolist() == [0] and seq.stats.prefix_tokens_reused == 0


def test_preemption_requeues_newest_and_everything_finishes():
    sched = make(num_pages=6, page_size=4, max_batch=4)
    rng = np.random.default_rng(3)
    seqs = [sched.add(str(i), list(rng.integers(0, 50, 6)), SamplingParams(max_tokens=10)) for i in range(4)]
    finished = drain(sched, rng)
    assert sched.num_preemptions > 0
    assert {s.request_id for s in finished} == {"0", "1", "2", "3"}
    assert all(s.num_output_tokens == 10 for s in seqs)
    assert sched.pool.num_free + sched.pool.num_evictable == 6


def test_cancel_frees_pages_at_once_even_in_flight():
    sched = make()
    sched.add("a", list(range(9)), SamplingParams(max_tokens=5))
    sched.add("b", list(range(50, 59)), SamplingParams(max_tokens=5))
    b = sched.schedule()
    free_before = sched.pool.num_free
    assert sched.cancel("a") and not sched.cancel("zzz")
    assert sched.pool.num_free == free_before + 3
    assert (b.slot_mapping[0] == -1).all()
    run_model(sched.pool, b)  # writes only b's slots
    assert sched.postprocess(b, np.array([1, 1])) == []
    assert b.seqs[0].finish_reason is FinishReason.CANCELLED
    sched.check_integrity()
    sched.add("a", [1], SamplingParams(max_tokens=1))  # id free again


def test_fork_shares_then_copies_on_write():
    sched = make()
    rng = np.random.default_rng(4)
    parent = sched.add("a", list(range(6)), SamplingParams(max_tokens=4, temperature=0))
    step(sched, rng)  # prefill; one token sampled; last page partial
    (child,) = sched.fork(parent, 1)
    assert child.pages == parent.pages and sched.pool.refcount(parent.pages[-1]) == 2
    shared = parent.pages[-1]
    before = sched.pool.k_pages(0)[shared].copy()
    b = sched.schedule()
    assert parent.pages[-1] != child.pages[-1]  # both got a private copy
    for s in (parent, child):
        np.testing.assert_array_equal(sched.pool.k_pages(0)[s.pages[-1]][:, :2], before[:, :2])
    run_model(sched.pool, b)
    sched.postprocess(b, np.array([7, 9]))
    check_kv_contents(sched)
    check_minmax(sched.pool)
    assert parent.token_ids[-1] == 7 and child.token_ids[-1] == 9
    sched.check_integrity()


def test_parallel_sampling_n():
    sched = make()
    rng = np.random.default_rng(5)
    sched.add("a", list(range(8)), SamplingParams(max_tokens=3, n=3))  # prompt ends on a page edge
    finished = drain(sched, rng)
    assert sorted(s.index for s in finished) == [0, 1, 2]
    assert all(s.num_output_tokens == 3 and s.token_ids[:8] == list(range(8)) for s in finished)


def test_stop_conditions():
    sched = make(eos_token_id=2, max_seq_len=12)
    a = sched.add("a", [1, 1], SamplingParams(max_tokens=8, stop_token_ids=[5]))
    b = sched.add("b", [1, 1], SamplingParams(max_tokens=8))
    c = sched.add("c", [1, 1], SamplingParams(max_tokens=8, ignore_eos=True))
    d = sched.add("d", [1] * 9, SamplingParams(max_tokens=8))
    b_ = sched.schedule()
    run_model(sched.pool, b_)
    sched.postprocess(b_, np.array([5, 2, 2, 3]))
    assert a.finish_reason is FinishReason.STOP and b.finish_reason is FinishReason.STOP
    assert c.status is SequenceStatus.RUNNING
    while sched.has_unfinished():  # never EOS from here on
        b_ = sched.schedule()
        run_model(sched.pool, b_)
        sched.postprocess(b_, np.full(len(b_), 3))
    assert d.num_tokens == 12 and d.finish_reason is FinishReason.LENGTH
    assert c.num_output_tokens == 8 and c.finish_reason is FinishReason.LENGTH


def test_add_rejects():
    sched = make(num_pages=4, page_size=4, max_seq_len=20)
    sched.add("a", [1], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already live"):
        sched.add("a", [1])
    with pytest.raises(ValueError, match="non-empty"):
        sched.add("b", [])
    with pytest.raises(ValueError, match="max_seq_len"):
        sched.add("b", [1] * 20)
    with pytest.raises(ValueError, match="pool holds"):
        make(num_pages=2, page_size=4).add("b", [1] * 5, SamplingParams(max_tokens=4))


def test_protocol_misuse_raises():
    sched = make()
    sched.add("a", [1, 2])
    b = sched.schedule()
    with pytest.raises(RuntimeError, match="before postprocess"):
        sched.schedule()
    with pytest.raises(ValueError, match="sampled tokens"):
        sched.postprocess(b, np.array([1, 2, 3]))


def test_stats_timestamps():
    t = iter(range(100))
    sched = make()
    sched.clock = lambda: float(next(t))
    seq = sched.add("a", [1, 2, 3], SamplingParams(max_tokens=2))
    drain(sched, np.random.default_rng(7))
    s = seq.stats
    assert s.arrival_time < s.first_scheduled_time < s.first_token_time < s.finish_time
    assert s.ttft == s.first_token_time - s.arrival_time


def test_record_selected_pages():
    sched = make()
    sched.add("a", list(range(9)))
    b = sched.schedule()
    sel = np.zeros((1, 2, b.page_table.shape[1]), bool)
    sel[0, 0, :2] = True
    sel[0, 1, :1] = True
    b.record_selected_pages(sel)
    assert b.seqs[0].stats.pages_selected == [1.5]
    with pytest.raises(ValueError, match="selected_pages"):
        b.record_selected_pages(sel[0])


def test_engine_loop_shape():
    """The loop an engine will run: schedule -> backend -> sample -> postprocess."""
    from tinyserve_trt.runtime import Sampler

    sched, sampler = make(), Sampler(seed=0)
    sched.add("a", [3, 1, 4, 1, 5], SamplingParams(max_tokens=4, seed=1, logprobs=1))
    rng = np.random.default_rng(0)
    while sched.has_unfinished():
        batch = sched.schedule()
        run_model(sched.pool, batch)
        logits = rng.standard_normal((len(batch), 16))
        sched.postprocess(batch, sampler(logits, batch.seqs, batch.sample_mask))
    (seq,) = [s for s in batch.seqs if s.request_id == "a"]
    assert seq.num_output_tokens == 4 and len(seq.output_logprobs) == 4
    assert len(seq.output_top_logprobs[0]) == 1


def test_short_contexts_decode_dense_per_row_in_a_mixed_batch():
    """sparse_min_ratio 2: a decode row keeps its budget (the engine's 8, or its request's)
    only once its context (cached + the new token) reaches twice that budget; below, budget 0.
    One decode batch holds both kinds; the boundary (context == 2 x budget) is sparse."""
    sched = make(token_budget=8, sparse_min_ratio=2.0)
    prompts = {"short": (3, None), "long": (20, None), "own4": (10, 4), "own0": (30, 0), "own16": (12, 16)}
    seqs = {k: sched.add(k, list(range(n)), SamplingParams(max_tokens=64, ignore_eos=True, token_budget=tb))
            for k, (n, tb) in prompts.items()}
    rng = np.random.default_rng(0)
    while any(s.num_output_tokens == 0 for s in seqs.values()):
        step(sched, rng)
    b = sched.schedule()
    assert len(b) == 5 and b.num_new_tokens.tolist() == [1] * 5
    got = {s.request_id: int(budget) for s, budget in zip(b.seqs, b.token_budget)}
    context = {s.request_id: int(p) + 1 for s, p in zip(b.seqs, b.past_lens)}
    assert context["short"] < 16 <= context["long"] and 8 <= context["own4"] < 32 and context["own16"] < 32
    assert got == {"short": 0, "long": 8, "own4": 4, "own0": 0, "own16": 0}
    run_model(sched.pool, b)
    sched.postprocess(b, np.zeros(len(b), np.int64))

    off = make(token_budget=8, sparse_min_ratio=0.0)  # 0: every decode row keeps its budget
    off.add("short", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    while off.running == [] or off.running[0].num_output_tokens == 0:
        step(off, rng)
    assert off.schedule().token_budget.tolist() == [8]


def test_sparse_min_ratio_boundary_is_sparse():
    from tinyserve_trt.runtime.batch import ScheduledBatch
    from tinyserve_trt.runtime.sequence import Sequence

    rows = []
    for n in (15, 16):  # contexts after the step: 15 (< 2 x 8: dense) and 16 (sparse)
        seq = Sequence(f"c{n}", list(range(n - 1)), SamplingParams())
        seq.token_ids.append(0)  # one generated token, not yet cached
        seq.pages, seq.num_cached_tokens = [0, 1, 2, 3], n - 1
        rows.append((seq, 1))
    assert ScheduledBatch.build(rows, 4, 8, 2.0).token_budget.tolist() == [0, 8]
    assert ScheduledBatch.build(rows, 4, 8, 1.5).token_budget.tolist() == [8, 8]
    assert ScheduledBatch.build(rows, 4, 0, 2.0).token_budget.tolist() == [0, 0]


def test_budget_share_grows_the_default_budget_with_the_context():
    """budget_share 1/8 over a floor of 8: contexts 15 / 64 / 100 get 8 / 8 / 12 (floor(100 / 8));
    a request's own budget stays fixed; sparse_min_ratio compares with the grown budget."""
    from tinyserve_trt.runtime.batch import ScheduledBatch
    from tinyserve_trt.runtime.sequence import Sequence

    rows = []
    for n, own in ((15, None), (64, None), (100, None), (100, 4)):
        seq = Sequence(f"c{n}-{own}", list(range(n - 1)), SamplingParams(token_budget=own))
        seq.token_ids.append(0)  # one generated token, not yet cached
        seq.pages, seq.num_cached_tokens = list(range(-(-n // 4))), n - 1
        rows.append((seq, 1))
    assert ScheduledBatch.build(rows, 4, 8, 0.0, 0.125).token_budget.tolist() == [8, 8, 12, 4]
    assert ScheduledBatch.build(rows, 4, 8, 0.0).token_budget.tolist() == [8, 8, 8, 4]  # share 0: fixed
    assert ScheduledBatch.build(rows, 4, 8, 8.0, 0.125).token_budget.tolist() == [0, 8, 12, 4]  # 100 >= 8 x 12
    sched = make(token_budget=8, budget_share=0.125, sparse_min_ratio=0.0)
    sched.add("long", list(range(100)), SamplingParams(max_tokens=4, ignore_eos=True))
    rng = np.random.default_rng(0)
    while sched.running == [] or sched.running[0].num_output_tokens == 0:
        step(sched, rng)
    assert sched.schedule().token_budget.tolist() == [12]  # context 101
