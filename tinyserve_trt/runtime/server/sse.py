"""EventStream: a server-sent-events response that notices the client leaving.

Sends ``data: <item>\\n\\n`` for each string of an async iterator. Meanwhile it
listens on the ASGI receive channel: when ``http.disconnect`` arrives the
stream is cancelled and the iterator closed at once, so a request that is
still queued or prefilling is aborted without waiting for its next token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from starlette.responses import Response

HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
           (b"x-accel-buffering", b"no")]


async def until_disconnected(receive) -> None:
    """Return when the client has gone (ASGI ``http.disconnect``); request bodies already read."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EventStream(Response):
    """``events`` (an async generator) yields the payloads (JSON text, or ``[DONE]``); it is
    always closed, and ``on_close()`` called exactly once, even when it never started."""

    def __init__(self, events: AsyncGenerator[str, None], on_close: Callable[[], None] = lambda: None):
        super().__init__(status_code=200)
        self.events, self.on_close = events, on_close

    async def __call__(self, scope, receive, send) -> None:
        async def stream():
            await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
            async for data in self.events:
                await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        streamer = asyncio.ensure_future(stream())
        watcher = asyncio.ensure_future(until_disconnected(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streamer, watcher):
                task.cancel()
            results = await asyncio.gather(streamer, watcher, return_exceptions=True)
            try:
                await self.events.aclose()  # runs the generator's cleanup (abort the request) now, not at GC
            finally:
                self.on_close()
        err = results[0]
        if isinstance(err, BaseException) and not isinstance(err, (asyncio.CancelledError, OSError)):
            raise err  # a bug in the stream; a send to a gone client (OSError) is not one
