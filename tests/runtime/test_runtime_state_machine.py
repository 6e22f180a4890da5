"""Random operation sequences over pool + prefix cache + scheduler, integrity after each.

Each rule is one thing an engine or a user can do (admit, step with fake sampled
tokens, cancel, fork, finish on a stop string); after every rule the pool
partition, refcounts vs page tables, prefix-cache entries, page K/V contents and
min/max metadata are checked. At teardown everything is drained and every page
must be free or cached with no holder.
"""

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tinyserve_trt.runtime.config import CacheConfig, SchedulerConfig
from tinyserve_trt.runtime.pages import PagePool
from tinyserve_trt.runtime.sampling import SamplingParams
from tinyserve_trt.runtime.scheduler import Scheduler
from tinyserve_trt.runtime.sequence import FinishReason

from tests.runtime.fakes import check_kv_contents, check_minmax, step

PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 0, 0], [6, 6, 6, 6, 6]]
prompts = st.builds(lambda p, t: p + t, st.sampled_from(PREFIXES),
                    st.lists(st.integers(0, 3), min_size=0, max_size=6)).filter(bool)
params = st.builds(SamplingParams, max_tokens=st.integers(1, 6), n=st.integers(1, 3),
                   seed=st.integers(0, 100), token_budget=st.none() | st.integers(0, 64))


class RuntimeMachine(RuleBasedStateMachine):
    prefix_cache = "hash"

    def __init__(self):
        super().__init__()
        pool = PagePool(CacheConfig(page_size=2, num_pages=10, dtype="float32",
                                    prefix_cache=self.prefix_cache), 1, 2, 2)
        self.sched = Scheduler(SchedulerConfig(max_batch=4, max_tokens_per_step=12, prefill_chunk=5,
                                               eos_token_id=7), pool)
        self.next_id = 0
        self.cancelled: set[str] = set()

    @rule(prompt=prompts, p=params)
    def add(self, prompt, p):
        self.sched.add(f"r{self.next_id}", prompt, p)
        self.next_id += 1

    @rule(seed=st.integers(0, 2**32 - 1))
    def step(self, seed):
        for seq in step(self.sched, np.random.default_rng(seed)):
            assert seq.is_finished and not seq.pages

    @rule(k=st.integers(0, 50))
    def cancel(self, k):
        rid = f"r{k}"
        live = rid in self.sched._requests
        assert self.sched.cancel(rid) == live
        if live:
            self.cancelled.add(rid)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(k=st.integers(0, 100), n=st.integers(1, 2))
    def fork(self, k, n):
        live = list(self.sched.waiting) + self.sched.running
        seq = live[k % len(live)]
        children = self.sched.fork(seq, n)
        assert all(c.pages == seq.pages and c.token_ids == seq.token_ids for c in children)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(k=st.integers(0, 100))
    def stop_string(self, k):
        live = list(self.sched.waiting) + self.sched.running
        self.sched.finish(live[k % len(live)], FinishReason.STOP)

    @invariant()
    def consistent(self):
        self.sched.check_integrity()
        check_kv_contents(self.sched)
        check_minmax(self.sched.pool)

    def teardown(self):
        rng = np.random.default_rng(0)
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            step(self.sched, rng)
            self.sched.check_integrity()
        assert not self.sched.has_unfinished()
        pool = self.sched.pool
        assert (pool._refcount == 0).all()
        assert pool.num_free + pool.num_evictable == pool.num_pages
        assert pool.num_evictable == self.sched.prefix_cache.num_entries


class RuntimeMachineNoSharing(RuntimeMachine):
    prefix_cache = "none"


SETTINGS = settings(max_examples=100, stateful_step_count=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestRuntime = RuntimeMachine.TestCase
TestRuntime.settings = SETTINGS
TestRuntimeNoSharing = RuntimeMachineNoSharing.TestCase
TestRuntimeNoSharing.settings = settings(SETTINGS, max_examples=20)
