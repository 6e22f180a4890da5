"""A failed copy-on-write fails only the request that needed it (issue #29, "nothing lost").

The tiny LLaMA package through ``LLM``/``Engine``: the storage's ``copy_page`` raises once
when a forked (``n = 2``) request first writes its shared last prompt page; that request
finishes with ``finish_reason="error"``, a request running beside it finishes normally, and
the same engine serves the next requests.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tinyserve_trt import LLM, AsyncLLM, SamplingParams
from tinyserve_trt.runtime.config import CacheConfig, SchedulerConfig
from tinyserve_trt.runtime.pages import PagePool
from tinyserve_trt.runtime.scheduler import Scheduler
from tinyserve_trt.runtime.sequence import FinishReason

from tests.runtime.fakes import check_kv_contents, run_model, step
from tests.runtime.storage_faults import InjectedFault, flaky

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
FORKED = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2)


def fail_copies(storage, monkeypatch, times: int = 1) -> list:
    """Make ``storage.copy_page`` raise on its first ``times`` calls; returns the calls."""
    copy, calls = storage.copy_page, []

    def flaky(src, dst):
        calls.append((src, dst))
        if len(calls) <= times:
            raise RuntimeError("injected copy failure")
        return copy(src, dst)

    monkeypatch.setattr(storage, "copy_page", flaky)
    return calls


@pytest.mark.parametrize("when", ["before", "after"])
def test_the_scheduler_fails_only_the_request_whose_copy_on_write_raised(when):
    pool = PagePool(CacheConfig(page_size=4, num_pages=12, dtype="float32"), 1, 2, 2)
    sched = Scheduler(SchedulerConfig(max_batch=4, max_tokens_per_step=32, prefill_chunk=8), pool)
    sched.add("forked", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, n=2, ignore_eos=True))
    sched.add("plain", [6, 7, 1, 2, 3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    rng = np.random.default_rng(0)
    while len(sched._requests["forked"]) < 2:  # prefill; the fork shares the last prompt page
        step(sched, rng)
    storage = flaky(pool)
    storage.arm("copy_page", when)
    batch = sched.schedule()
    failed = sched.take_failed()
    assert storage.raised == ["copy_page"] and sched.take_failed() == []
    assert [s.request_id for s in failed] == ["forked", "forked"]
    assert all(s.finish_reason is FinishReason.ERROR and isinstance(s.error, InjectedFault) and not s.pages
               for s in failed)
    assert [s.request_id for s in batch.seqs] == ["plain"]  # the others run this very step
    sched.check_integrity()
    run_model(pool, batch)
    sched.postprocess(batch, rng.integers(0, 8, size=len(batch)))
    while sched.has_unfinished():
        step(sched, rng)
        sched.check_integrity()
        check_kv_contents(sched)
    assert pool.num_free + pool.num_evictable == pool.num_pages


def test_a_failed_copy_on_write_fails_one_request_and_the_engine_goes_on(llama, monkeypatch):
    with LLM(llama[1], dense=True) as llm:
        engine = llm.engine
        calls = fail_copies(engine.pool.storage, monkeypatch)
        forked, plain = llm.generate(prompt_token_ids=[[5, 6, 7, 8, 9], [1, 2, 3]], params=[FORKED, GREEDY])
        assert calls, "the forked request never copied a shared page"
        assert forked.finished and [o.finish_reason for o in forked.outputs] == ["error", "error"]
        assert plain.outputs[0].finish_reason == "length" and len(plain.outputs[0].token_ids) == 6
        engine.scheduler.check_integrity()
        assert engine.stats()["pages_in_use"] == 0 and not engine.has_unfinished()
        assert engine.stats()["step_failures"] == 0  # no step was aborted: only one request failed
        (again,) = llm.generate(prompt_token_ids=[[5, 6, 7, 8, 9]], params=FORKED)  # the same engine serves
        assert [(o.finish_reason, len(o.token_ids)) for o in again.outputs] == [("length", 6)] * 2
        ref = llm.generate(prompt_token_ids=[[5, 6, 7, 8, 9]], params=GREEDY)[0].outputs[0].token_ids
        assert again.outputs[0].token_ids == again.outputs[1].token_ids == ref
        engine.scheduler.check_integrity()


def test_async_llm_answers_a_failed_copy_on_write_with_step_failed(llama, monkeypatch):
    from tinyserve_trt.runtime.engine import StepFailed

    async def run(engine, prompt, params):
        try:
            async for r in engine.generate(prompt_token_ids=prompt, params=params):
                pass
            return [len(o.token_ids) for o in r.outputs]
        except RuntimeError as e:
            return e

    async def main():
        engine = AsyncLLM(llama[1], dense=True)
        try:
            calls = fail_copies(engine.engine.pool.storage, monkeypatch)
            got = await asyncio.wait_for(asyncio.gather(run(engine, [5, 6, 7, 8, 9], FORKED),
                                                        run(engine, [1, 2, 3], GREEDY)), 60)
            again = await asyncio.wait_for(run(engine, [5, 6, 7, 8, 9], FORKED), 60)
            in_use = await engine.run_on_engine(lambda e: (e.scheduler.check_integrity(), e.stats()["pages_in_use"]))
            return calls, got, again, in_use[1], engine.is_alive
        finally:
            engine.shutdown()

    calls, (failed, plain), again, in_use, alive = asyncio.run(main())
    assert calls and isinstance(failed, StepFailed) and "injected copy failure" in str(failed.cause)
    assert plain == [6] and again == [6, 6] and in_use == 0 and alive


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
