"""10,000 short random requests with random cancels through a pool that cannot hold them at once."""

import time

import numpy as np

from tinyserve_trt.runtime.config import CacheConfig, SchedulerConfig
from tinyserve_trt.runtime.pages import PagePool
from tinyserve_trt.runtime.sampling import SamplingParams
from tinyserve_trt.runtime.scheduler import Scheduler
from tinyserve_trt.runtime.sequence import FinishReason

from tests.runtime.fakes import step

NUM_REQUESTS = 10_000


def test_stress_many_requests_small_pool():
    rng = np.random.default_rng(1234)
    pool = PagePool(CacheConfig(page_size=4, num_pages=48, dtype="float16"), 1, 1, 2)
    sched = Scheduler(SchedulerConfig(max_batch=32, max_tokens_per_step=128, prefill_chunk=16,
                                      eos_token_id=0), pool)
    shared = [list(rng.integers(1, 50, 12)) for _ in range(4)]  # common system prompts
    seqs, cancelled = [], set()
    start, steps = time.perf_counter(), 0
    while len(seqs) < NUM_REQUESTS or sched.has_unfinished():
        for _ in range(min(int(rng.poisson(8)), NUM_REQUESTS - len(seqs))):
            tail = list(rng.integers(1, 50, int(rng.integers(1, 20))))
            prompt = (shared[int(rng.integers(4))] if rng.random() < 0.5 else []) + tail
            params = SamplingParams(max_tokens=int(rng.integers(1, 12)), n=1 + int(rng.random() < 0.05),
                                    seed=int(rng.integers(1 << 30)))
            seqs.append(sched.add(f"r{len(seqs)}", prompt, params))
        if rng.random() < 0.3 and seqs:
            rid = f"r{int(rng.integers(len(seqs)))}"
            if sched.cancel(rid):
                cancelled.add(rid)
        step(sched, rng, vocab=64)
        steps += 1
        if steps % 100 == 0:
            sched.check_integrity()
    elapsed = time.perf_counter() - start

    sched.check_integrity()
    assert len(seqs) == NUM_REQUESTS
    assert all(s.is_finished for s in seqs)
    for s in seqs:
        if s.finish_reason is FinishReason.CANCELLED:
            assert s.request_id in cancelled
        else:
            assert s.num_output_tokens == s.params.max_tokens or s.token_ids[-1] == 0
    assert (pool._refcount == 0).all()
    assert pool.num_free + pool.num_evictable == pool.num_pages
    assert sched.num_preemptions > 0 and len(cancelled) > 0
    print(f"{NUM_REQUESTS} requests, {steps} steps, {sched.num_preemptions} preemptions, "
          f"{len(cancelled)} cancelled, {elapsed:.1f} s")
