"""Random page-pool operations with storage failures injected (issue #29, STYLE principle 5).

``PoolFaultMachine``: page tables (``holders``) over a flat or tiered pool whose storage
(``storage_faults.FlakyStorage``) raises on the calls hypothesis picks - reset (allocate),
copy (copy-on-write, promote), demote - before or after its data move. After every rule
``check_integrity(holders, check_data=True)`` passes, and an operation that raised left
the pool as it was: free lists, LRU, refcounts, cached flags, handle bindings, live pages'
valid counts and data, and the page tables (a cached page it had to evict stays evicted).

``SchedulerFaultMachine``: the runtime machine of ``test_runtime_state_machine`` with
faulty steps: a failed reservation fails only its request (``FinishReason.ERROR``, no
pages) and the runtime's invariants hold after every step.
"""

from __future__ import annotations

import copy

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tinyserve_trt.runtime.config import CacheConfig
from tinyserve_trt.runtime.pages import OutOfPagesError, PagePool
from tinyserve_trt.runtime.sequence import FinishReason
from tinyserve_trt.runtime.tiers import TierConfig, TieredPagePool

from tests.runtime.fakes import step as fake_step
from tests.runtime.storage_faults import FAULTY, InjectedFault, check_unchanged, flaky, pool_state
from tests.runtime.test_runtime_state_machine import RuntimeMachine

PS, L, H, D = 2, 2, 1, 2
faults = st.none() | st.tuples(st.sampled_from(FAULTY), st.sampled_from(["before", "after"]))
picks = st.integers(0, 1000)


class PoolFaultMachine(RuleBasedStateMachine):
    tiered = False

    def __init__(self):
        super().__init__()
        cache = CacheConfig(page_size=PS, num_pages=8, dtype="float32")
        self.pool = (TieredPagePool(cache, TierConfig(num_cold_pages=4), L, H, D) if self.tiered
                     else PagePool(cache, L, H, D))
        self.storage = flaky(self.pool)
        self.holders: list[list[int]] = []
        self.evicted: list[int] = []
        self.pool.set_evict_callback(self.evicted.append)
        self.rng = np.random.default_rng(0)

    # ---- helpers --------------------------------------------------------------
    def attempt(self, fault, op):
        """``op()`` with ``fault`` armed; its result, or None when it raised (then the pool and
        the page tables must be as before, give or take the evictions it made)."""
        before, tables = pool_state(self.pool), copy.deepcopy(self.holders)
        self.evicted.clear()
        if fault is not None:
            self.storage.arm(*fault)
        try:
            return op()
        except (InjectedFault, OutOfPagesError) as e:
            event(f"{type(e).__name__} in {op.__qualname__.split('.')[1]} with {fault}")
            assert self.holders == tables
            check_unchanged(before, pool_state(self.pool), self.evicted)
            return None
        finally:
            self.storage.disarm()

    def held(self, k: int, j: int) -> tuple[int, int, int]:
        """(holder index, logical index, page) of the ``k``-th holder's ``j``-th page."""
        i = k % len(self.holders)
        pages = self.holders[i]
        return i, j % len(pages), pages[j % len(pages)]

    def valid(self, page: int) -> int:
        return int(self.pool.num_valid(0)[self.pool._physical_ids(np.array([page]))[0]])

    # ---- rules ----------------------------------------------------------------
    @rule(n=st.integers(1, 2), fault=faults)
    def allocate(self, n, fault):
        pages = self.attempt(fault, lambda: self.pool.allocate(n))
        if pages is not None:
            self.holders.append(pages)

    @precondition(lambda self: self.holders)
    @rule(k=picks)
    def write(self, k):
        """Fill a writable hot page's remaining tokens (only full pages can be demoted)."""
        pages = [p for p in dict.fromkeys(p for h in self.holders for p in h) if self.pool.is_writable(p)
                 and (not self.tiered or self.pool.is_hot(p)) and self.valid(p) < PS]
        if not pages:
            return
        page = pages[k % len(pages)]
        start = self.valid(page)
        for layer in range(L):
            key = self.rng.standard_normal((PS - start, H, D)).astype(np.float32)
            self.pool.write_tokens(layer, page * PS + np.arange(start, PS), key, -key)

    @precondition(lambda self: self.holders)
    @rule(k=picks)
    def share(self, k):
        pages = list(self.holders[k % len(self.holders)])
        for page in pages:
            self.pool.incref(page)
        self.holders.append(pages)

    @precondition(lambda self: self.holders)
    @rule(k=picks, j=picks, fault=faults)
    def copy_on_write(self, k, j, fault):
        i, j, src = self.held(k, j)
        dst = self.attempt(fault, lambda: self.pool.allocate(1, fill=lambda p: self.pool.copy_page(src, p[0])))
        if dst is not None:
            self.pool.decref(src)
            self.holders[i][j] = dst[0]

    @precondition(lambda self: self.holders)
    @rule(k=picks)
    def release(self, k):
        for page in reversed(self.holders.pop(k % len(self.holders))):
            self.pool.decref(page)

    @precondition(lambda self: self.holders)
    @rule(k=picks, j=picks)
    def cache(self, k, j):
        self.pool.mark_cached(self.held(k, j)[2])

    @precondition(lambda self: self.pool.cached_pages())
    @rule(k=picks)
    def uncache(self, k):
        cached = self.pool.cached_pages()
        self.pool.unmark_cached(cached[k % len(cached)])

    @precondition(lambda self: self.tiered)
    @rule(k=picks, fault=faults)
    def demote(self, k, fault):
        full = [p for p in self.pool.hot_pages() if self.pool.is_full(p)]
        if full:
            self.attempt(fault, lambda: self.pool.demote(full[k % len(full)]))

    @precondition(lambda self: self.tiered)
    @rule(k=picks, fault=faults)
    def promote(self, k, fault):
        cold = self.pool.cold_pages()
        if cold:
            self.attempt(fault, lambda: self.pool.promote(cold[k % len(cold)]))

    @invariant()
    def whole(self):
        self.pool.check_integrity(self.holders, check_data=True)

    def teardown(self):
        while self.holders:
            self.release(0)
        for page in self.pool.cached_pages():
            self.pool.unmark_cached(page)
        assert self.pool.num_free == self.pool.num_pages
        self.pool.check_integrity([], check_data=True)


class TieredPoolFaultMachine(PoolFaultMachine):
    tiered = True


class SchedulerFaultMachine(RuntimeMachine):
    def __init__(self):
        super().__init__()
        self.storage = flaky(self.sched.pool)

    @rule(seed=st.integers(0, 2**32 - 1), fault=faults)
    def faulty_step(self, seed, fault):
        if fault is not None:
            self.storage.arm(*fault)
        try:
            for seq in fake_step(self.sched, np.random.default_rng(seed)):
                assert seq.is_finished and not seq.pages
        finally:
            self.storage.disarm()
        failed = self.sched.take_failed()
        event(f"step with {fault}: {len(failed)} sequences failed")
        for seq in failed:
            assert seq.finish_reason is FinishReason.ERROR and isinstance(seq.error, InjectedFault)
            assert not seq.pages and seq.request_id not in self.sched._requests


SETTINGS = settings(max_examples=100, stateful_step_count=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestPoolFaults = PoolFaultMachine.TestCase
TestPoolFaults.settings = SETTINGS
TestTieredPoolFaults = TieredPoolFaultMachine.TestCase
TestTieredPoolFaults.settings = SETTINGS
TestSchedulerFaults = SchedulerFaultMachine.TestCase
TestSchedulerFaults.settings = settings(SETTINGS, max_examples=40)
