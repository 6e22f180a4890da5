"""Reads prefetched ahead of admission (issue #33): a queued request's stored pages are read on
the prefetcher's thread, admission only copies them in; a prefetch still queued, in progress,
failed or dropped costs at most a synchronous read, never a wrong page or a request."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.runtime.test_page_store_prefix import compute, evict_all
from tinyserve_trt.runtime.config import CacheConfig, SchedulerConfig
from tinyserve_trt.runtime.kvstore import StoreIdentity, make_page_store
from tinyserve_trt.runtime.kvstore.base import PageStore
from tinyserve_trt.runtime.kvstore.prefetch import THREAD_NAME, Prefetcher
from tinyserve_trt.runtime.pages import PagePool
from tinyserve_trt.runtime.prefix_cache import make_prefix_cache
from tinyserve_trt.runtime.scheduler import Scheduler

L, HKV, D, PS = 2, 1, 2, 4


class SlowStore(PageStore):
    """A host store whose prefetcher reads wait for ``gate`` (open by default); every read is
    logged by thread; ``fail_in``: thread-name prefixes whose reads raise."""

    def __init__(self, inner: PageStore):
        super().__init__(inner.identity)
        self.inner, self.tier = inner, inner.tier
        self.gate, self.started = threading.Event(), threading.Event()
        self.gate.set()
        self.reads: list[tuple[str, int]] = []  # (thread name, pages asked)
        self.fail_in: tuple[str, ...] = ()

    def contains(self, page_hash):
        return self.inner.contains(page_hash)

    def get_many(self, hashes):
        name = threading.current_thread().name
        self.reads.append((name, len(hashes)))
        if name.startswith(THREAD_NAME):
            self.started.set()
            assert self.gate.wait(30), "the test never opened the gate"
        if name.startswith(self.fail_in) and self.fail_in:
            raise OSError("the disk went away")
        return self.inner.get_many(hashes)

    def put(self, page_hash, block):
        return self.inner.put(page_hash, block)

    @property
    def nbytes(self):
        return self.inner.nbytes

    @property
    def num_entries(self):
        return self.inner.num_entries


def setup(num_pages=4):
    pool = PagePool(CacheConfig(page_size=PS, num_pages=num_pages, dtype="float32"), L, HKV, D)
    ident = StoreIdentity(package="t", num_layers=L, num_kv_heads=HKV, page_size=PS, head_dim=D, dtype="float32")
    store = SlowStore(make_page_store("host", ident, host_bytes=1 << 20))
    cache = make_prefix_cache("hash", pool, store=store)
    return pool, cache, store


def stored_prefix(pool, cache, tokens, seed=1):
    """``tokens`` computed, then evicted to the store; their pages' data."""
    data = compute(pool, cache, tokens, seed)
    evict_all(pool, cache)
    return data


def check_restored(pool, cache, pages, data):
    assert len(pages) == len(data)
    for page, want in zip(pages, data):
        got = pool.storage.read_block(page)
        assert all(np.array_equal(got[k], want[k]) for k in ("k", "v", "key_min", "key_max"))
    pool.check_integrity([pages], check_data=True)
    cache.check_integrity()


def test_a_prefetch_reads_on_its_thread_and_the_match_only_copies():
    pool, cache, store = setup()
    tokens = list(range(8))
    data = stored_prefix(pool, cache, tokens)
    store.reads.clear()
    handle = cache.prefetch(tokens + [0])
    assert handle is not None and len(handle.hashes) == 2
    handle.future.result(timeout=30)  # read before the match runs
    assert [name.startswith(THREAD_NAME) for name, _ in store.reads] == [True]
    pages, _ = cache.match(tokens + [0], prefetch=handle)
    assert len(store.reads) == 1  # the match read nothing itself
    assert cache.last_match_tiers == {"host": 2}
    check_restored(pool, cache, pages, data)
    s = cache.prefetcher.stats()
    assert s["prefetch_used"] == 1 and s["prefetch_pages_read"] == 2 and s["prefetch_held_pages"] == 0
    cache.close()


def test_a_match_waits_for_a_read_in_progress_instead_of_reading_again():
    pool, cache, store = setup()
    tokens = list(range(8))
    data = stored_prefix(pool, cache, tokens)
    store.reads.clear()
    store.gate.clear()
    store.started.clear()
    handle = cache.prefetch(tokens + [0])
    assert store.started.wait(30)  # the worker is inside the read now
    count = cache.prefetcher._count

    def open_gate_when_waiting(name):  # the match found the read in progress: let it finish
        count(name)
        if name == "waited":
            store.gate.set()

    cache.prefetcher._count = open_gate_when_waiting
    pages, _ = cache.match(tokens + [0], prefetch=handle)
    assert len(store.reads) == 1 and store.reads[0][0].startswith(THREAD_NAME)
    check_restored(pool, cache, pages, data)
    assert cache.prefetcher.counters["waited"] == 1 and cache.prefetcher.counters["used"] == 1
    cache.close()


def test_a_prefetch_still_queued_is_cancelled_and_read_at_admission():
    pool, cache, store = setup(num_pages=6)
    a, b = list(range(8)), list(range(100, 108))
    data_a = compute(pool, cache, a, 1)
    data_b = compute(pool, cache, b, 2)
    evict_all(pool, cache)
    store.reads.clear()
    store.gate.clear()
    store.started.clear()
    first = cache.prefetch(a + [0])  # the worker blocks inside this one
    assert store.started.wait(30)
    second = cache.prefetch(b + [0])  # queued behind it
    pages_b, _ = cache.match(b + [0], prefetch=second)
    assert cache.prefetcher.counters["cancelled"] == 1
    assert [name for name, _ in store.reads][-1] == threading.current_thread().name  # read synchronously
    check_restored(pool, cache, pages_b, data_b)
    store.gate.set()
    pages_a, _ = cache.match(a + [0], prefetch=first)
    assert pool.storage.read_block(pages_a[0])["k"].tobytes() == data_a[0]["k"].tobytes()
    assert cache.prefetcher.held_pages == 0
    cache.close()


@pytest.mark.parametrize("fails", ["prefetch only", "every read"])
def test_a_failed_prefetch_costs_a_read_or_the_reuse_never_the_pages(fails, caplog):
    pool, cache, store = setup()
    tokens = list(range(8))
    data = stored_prefix(pool, cache, tokens)
    store.fail_in = (THREAD_NAME,) if fails == "prefetch only" else ("",)
    handle = cache.prefetch(tokens + [0])
    with pytest.raises(OSError):
        handle.future.result(timeout=30)
    free = pool.num_free
    pages, _ = cache.match(tokens + [0], prefetch=handle)
    assert cache.prefetcher.counters["failed"] == 1 and any("prefetch failed" in r.message for r in caplog.records)
    if fails == "prefetch only":
        check_restored(pool, cache, pages, data)  # read at admission instead
    else:
        assert pages == [] and pool.num_free == free  # recomputed; the pool is as it was
        pool.check_integrity([], check_data=True)
        cache.check_integrity()
    cache.close()


def test_prefetches_are_bounded_by_the_pool_and_dropped_with_their_request():
    from tinyserve_trt.runtime.sampling import SamplingParams

    pool, cache, _ = setup(num_pages=8)
    tokens = list(range(16))
    stored_prefix(pool, cache, tokens)
    scheduler = Scheduler(SchedulerConfig(), pool, prefix_cache=cache)
    one = SamplingParams(max_tokens=1)
    scheduler.add("a", tokens + [0], one)  # 4 pages each: two fill the pool's worth
    scheduler.add("b", tokens + [1], one)
    assert cache.prefetcher.held_pages == 8
    scheduler.add("c", tokens + [2], one)  # no room left: read at admission instead
    assert cache.prefetcher.counters["skipped"] == 1 and len(scheduler._prefetches) == 2
    scheduler.cancel("a")  # left before admission: its prefetch goes with it
    assert cache.prefetcher.held_pages == 4 and cache.prefetcher.counters["dropped"] == 1
    scheduler.check_integrity()
    batch = scheduler.schedule()  # b is admitted with its prefetched pages
    assert cache.prefetcher.held_pages == 0 and not scheduler._prefetches
    assert batch.seqs[0].request_id == "b" and batch.seqs[0].stats.prefix_pages_by_tier == {"host": 4}
    scheduler.check_integrity()
    cache.close()
    assert cache.prefetch(tokens + [0]) is None  # closed: no read after the store closes


def test_prefetcher_options_are_validated():
    with pytest.raises(ValueError, match="max_pages"):
        Prefetcher(None, max_pages=0)


def test_the_engine_reads_a_queued_prompt_before_admitting_it(llama, monkeypatch):
    """Through the engine: the stored prefix is read on the prefetcher's thread while the request
    waits; greedy ids equal a recomputation's."""
    from tests.runtime.test_page_store_engine import GREEDY, prompts, small_llm
    from tinyserve_trt.runtime.kvstore import host
    from tinyserve_trt.runtime.llm import LLM
    from tinyserve_trt.runtime.sequence import SequenceStatus

    _, pkg, manifest = llama
    ps = prompts(3, seed=5)
    ref = LLM(pkg, prefix_sharing=False, max_batch=2, dense=True)
    want = [o.outputs[0].token_ids for o in ref.generate(prompt_token_ids=ps, params=GREEDY)]
    ref.close()
    llm = small_llm(pkg, manifest, kv_cache_host_gb=0.01)
    for p in ps:  # the later ones evict the first
        llm.generate(prompt_token_ids=[p], params=GREEDY)
    engine = llm.engine
    reads, real = [], host.HostPageStore.get_many

    def logged(self, hashes):
        waiting = [s for s in engine.scheduler.waiting if s.request_id == "again"]
        reads.append((threading.current_thread().name, bool(waiting) and waiting[0].status is SequenceStatus.WAITING))
        return real(self, hashes)

    monkeypatch.setattr(host.HostPageStore, "get_many", logged)
    seq = engine.add_request("again", ps[0], GREEDY)
    engine.scheduler._prefetches[("again", 0)].future.result(timeout=60)
    while engine.has_unfinished():
        engine.step()
    assert seq.output_token_ids == want[0]
    assert reads and all(name.startswith(THREAD_NAME) and queued for name, queued in reads)
    s = llm.stats()
    assert s["kv_prefetch_used"] >= 1 and seq.stats.prefix_pages_by_tier == {"host": 10}
    engine.scheduler.check_integrity()
    llm.close()
