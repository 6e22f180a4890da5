"""Running one HTTP request's prompts on the shared AsyncLLM, under a deadline.

``outputs`` merges the snapshot streams of a request's prompts (a completion may
carry a list of prompts) into one ``(prompt_index, RequestOutput)`` stream;
closing it, the deadline passing or an error cancels every prompt still
running, which aborts it in the engine and frees its pages.
``until_done_or_gone`` races a coroutine against the client disconnecting.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from collections.abc import AsyncIterator, Awaitable

from tinyserve_trt.runtime.async_llm import AsyncLLM
from tinyserve_trt.runtime.outputs import RequestOutput
from tinyserve_trt.runtime.sampling import SamplingParams
from tinyserve_trt.runtime.server.sse import until_disconnected


class RequestTimeout(Exception):
    """The request ran past the server's ``timeout``; it has been aborted."""


_DEADLINE = object()


class ClientGone(Exception):
    """The client disconnected before the answer was ready; the request has been aborted."""


async def outputs(llm: AsyncLLM, prompts: list[list[int]], params: SamplingParams, request_id: str,
                  deadline: float | None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Snapshots of every prompt as they come; ``deadline`` is ``loop.time()`` seconds or None.

    Raises RequestTimeout past the deadline, and whatever a prompt's generation raised
    (ValueError for a request the engine refused, RuntimeError if the engine died).
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, ids: list[int]) -> None:
        try:
            async with aclosing(llm.generate(prompt_token_ids=ids, params=params,
                                             request_id=f"{request_id}-{i}")) as stream:
                async for out in stream:
                    queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, ids)) for i, ids in enumerate(prompts)]
    # The deadline is a sentinel in the same queue, not asyncio.wait_for: on Python < 3.12
    # wait_for swallows a cancellation that lands as its item arrives, and a client that
    # left would keep its request decoding.
    timer = None if deadline is None else loop.call_at(deadline, queue.put_nowait, (-1, _DEADLINE))
    pending = len(prompts)
    try:
        while pending:
            i, item = await queue.get()
            if item is _DEADLINE:
                raise RequestTimeout
            if isinstance(item, Exception):
                raise item
            pending -= item.finished
            yield i, item
    finally:
        if timer is not None:
            timer.cancel()
        for task in tasks:
            task.cancel()  # a running prompt's generator closes: AsyncLLM aborts it
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_done_or_gone(work: Awaitable, receive):
    """``await work`` unless the client disconnects first: then cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()
