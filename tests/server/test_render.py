"""render.Renderer without HTTP: jobs in worker processes, a deadline that kills the worker
(the next job gets a fresh one), the output-size and token limits, a cancelled job."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.server.conftest import package_with_template
from tinyserve_trt.runtime.server.render import Renderer, RenderError

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def looping(llama, tmp_path_factory):
    return package_with_template(llama[1], tmp_path_factory.mktemp("render"), "loop", LOOP)


def test_jobs_match_the_package_and_limits_hold(llama):
    from tinyserve_trt.runtime.model_package import ModelPackage

    package = ModelPackage.load(llama[1])

    async def main():
        r = Renderer(llama[1], workers=1, timeout_s=30)
        try:
            assert await r.chat(CHAT, 1000) == package.encode(package.apply_chat_template(CHAT),
                                                               add_special_tokens=False)
            assert await r.encode(["hello", "ab"], 1000) == [package.encode("hello"), package.encode("ab")]
            with pytest.raises(RenderError) as e:
                await r.encode(["x" * 101], 100)
            assert (e.value.kind, e.value.chars) == ("too_long", 101)
            with pytest.raises(RenderError) as e:
                await r.encode(["x" * 50], 100, max_tokens=50)
            assert (e.value.kind, e.value.tokens) == ("too_long", 50)
            with pytest.raises(RenderError) as e:
                await r.encode(["\ud800"], 100)  # a lone surrogate (JSON allows its escape)
            assert e.value.kind == "tokenizer"
            assert await r.encode(["ok"], 100) == [package.encode("ok")]  # the same worker goes on
        finally:
            await r.close()

    asyncio.run(main())


def test_a_job_past_its_deadline_kills_the_worker_and_the_next_gets_a_fresh_one(looping):
    async def main():
        r = Renderer(looping, workers=1, timeout_s=1.0)
        try:
            await r.encode(["warm"], 100)  # starts the worker
            (first,) = r._idle
            t0 = time.monotonic()
            with pytest.raises(RenderError) as e:
                await r.chat(CHAT, 1000)
            assert e.value.kind == "timeout" and time.monotonic() - t0 < 3
            assert await first.proc.wait() is not None  # killed, not left burning a CPU
            assert await r.encode(["again"], 100)
            assert r._idle and r._idle[0] is not first
            task = asyncio.ensure_future(r.chat(CHAT, 1000))  # a cancelled job kills its worker too
            await asyncio.sleep(0.3)
            (busy,) = r._busy
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert await busy.proc.wait() is not None and not r._busy
        finally:
            await r.close()

    asyncio.run(main())


def test_warmup_renders_through_the_renderer(looping, llama):
    from tinyserve_trt.runtime.server.warmup import render_token_ids, warmup_token_ids
    from tinyserve_trt.runtime.model_package import ModelPackage

    items = [{"prompt": "hello"}, {"messages": CHAT}]

    async def main(pkg, timeout):
        r = Renderer(pkg, workers=1, timeout_s=timeout)
        try:
            return await render_token_ids(r, items)
        finally:
            await r.close()

    assert asyncio.run(main(llama[1], 30)) == warmup_token_ids(ModelPackage.load(llama[1]), items)
    with pytest.raises(ValueError, match="warmup prompt 2: timeout"):
        asyncio.run(main(looping, 1.0))
