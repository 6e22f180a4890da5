"""AsyncLLM shutdown and engine-thread death answer everyone (issue #29, "nothing lost").

A fake slow step (``engine.step`` monkeypatched to wait on an event) holds the engine
thread inside a step, so the races are deterministic: ``shutdown`` must never close the
engine under a running step, and a command queued while the thread is about to die (or
submitted after it died or shut down) must fail fast instead of being awaited forever.
Every wait in these tests is bounded.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from tinyserve_trt import AsyncLLM, SamplingParams
from tinyserve_trt.runtime.engine import EngineBroken

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
WAIT = 10  # seconds: the bound on every wait here


class SlowStep:
    """``engine.step`` that signals ``started``, waits for ``release``, then steps (or raises
    ``error``); ``engine.close`` records whether a step was running when it was called."""

    def __init__(self, engine, error: BaseException | None = None):
        self.engine, self.error = engine, error
        self.started, self.release = threading.Event(), threading.Event()
        self.in_step, self.closed_in_step, self.closes = False, None, 0
        self._step, self._close = engine.step, engine.close
        engine.step, engine.close = self.step, self.close

    def step(self):
        self.in_step = True
        self.started.set()
        try:
            assert self.release.wait(WAIT), "the test never released the step"
            if self.error is not None:
                raise self.error
            return self._step()
        finally:
            self.in_step = False

    def close(self):
        self.closes += 1
        self.closed_in_step = self.in_step
        self._close()


async def collect(llm, prompt):
    """Run one request to its end: its snapshots' count, or the exception it failed with."""
    n = 0
    try:
        async for _ in llm.generate(prompt_token_ids=prompt, params=GREEDY):
            n += 1
        return n
    except RuntimeError as e:
        return e


async def wait_event(event: threading.Event) -> None:
    assert await asyncio.get_running_loop().run_in_executor(None, event.wait, WAIT)


def test_shutdown_never_closes_the_engine_under_a_running_step(llama):
    async def main():
        llm = AsyncLLM(llama[1], dense=True)
        slow = SlowStep(llm.engine)
        task = asyncio.ensure_future(collect(llm, [5, 6, 7]))
        await wait_event(slow.started)
        llm.shutdown(timeout=0.2)  # the step is still running: it must not close the engine
        closed_early = slow.closes
        alive = llm._thread.is_alive()
        slow.release.set()
        result = await asyncio.wait_for(task, WAIT)
        llm._thread.join(WAIT)
        return closed_early, alive, result, slow, llm

    closed_early, alive, result, slow, llm = asyncio.run(main())
    assert closed_early == 0 and alive  # shutdown returned without closing under the step
    assert not llm._thread.is_alive() and slow.closes == 1 and slow.closed_in_step is False  # closed after it
    assert isinstance(result, RuntimeError) and "shut down" in str(result)


def test_shutdown_joins_an_idle_or_quick_thread_then_closes(llama):
    async def main():
        llm = AsyncLLM(llama[1], dense=True)
        slow = SlowStep(llm.engine)
        slow.release.set()  # steps run straight through
        got = await asyncio.wait_for(collect(llm, [5, 6, 7]), WAIT)
        llm.shutdown(timeout=WAIT)
        return got, slow, llm

    got, slow, llm = asyncio.run(main())
    assert got >= 1 and not llm._thread.is_alive() and slow.closes == 1 and slow.closed_in_step is False


def test_commands_queued_when_the_engine_thread_dies_fail_fast(llama):
    async def main():
        llm = AsyncLLM(llama[1], dense=True)
        slow = SlowStep(llm.engine, error=EngineBroken("injected: the pool is broken"))
        first = asyncio.ensure_future(collect(llm, [5, 6, 7]))
        await wait_event(slow.started)
        # queued while the thread is inside the step that is about to kill it
        queued = asyncio.ensure_future(collect(llm, [8, 9]))
        call = asyncio.ensure_future(llm.run_on_engine(lambda e: e.stats()))
        await asyncio.sleep(0.05)
        slow.release.set()
        done = await asyncio.wait_for(asyncio.gather(first, queued, call, return_exceptions=True), WAIT)
        llm._thread.join(WAIT)
        with pytest.raises(RuntimeError, match="engine thread died"):  # and after its death
            await asyncio.wait_for(collect_raising(llm, [1, 2]), WAIT)
        with pytest.raises(RuntimeError, match="engine thread died"):
            await asyncio.wait_for(llm.run_on_engine(lambda e: None), WAIT)
        llm.shutdown(timeout=WAIT)
        return done, llm

    (first, queued, call), llm = asyncio.run(main())
    assert not llm.is_alive and isinstance(llm.error, EngineBroken)
    for got in (first, queued, call):
        assert isinstance(got, RuntimeError) and "engine thread died" in str(got) and "injected" in str(got)


async def collect_raising(llm, prompt):
    async for _ in llm.generate(prompt_token_ids=prompt, params=GREEDY):
        pass


def test_submitting_after_shutdown_fails_fast(llama):
    async def main():
        llm = AsyncLLM(llama[1], dense=True)
        llm.shutdown(timeout=WAIT)
        with pytest.raises(RuntimeError, match="shut down"):
            await asyncio.wait_for(collect_raising(llm, [1, 2]), WAIT)
        with pytest.raises(RuntimeError, match="shut down"):
            await asyncio.wait_for(llm.run_on_engine(lambda e: None), WAIT)
        llm.abort("nobody")  # harmless
        llm.shutdown()  # twice: nothing to do
        return llm

    llm = asyncio.run(main())
    assert not llm._thread.is_alive() and llm.error is None
