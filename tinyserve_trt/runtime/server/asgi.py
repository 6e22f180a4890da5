"""Driving an ASGI app in-process, without a socket: one request, and the lifespan.

A Ray Serve replica runs the same FastAPI app as ``tinyserve serve`` (``create_app``)
but receives requests as method calls, not HTTP. ``call`` feeds one request (scope +
body) to the app and yields what the app sends: first ``{"status", "headers"}``, then
body chunks (bytes) as they are produced (a stream stays a stream). Closing the
iterator cancels the app's task, as a client disconnect would: the request is aborted
and its pages freed. ``Lifespan`` runs the app's startup and shutdown.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

_END = object()


def http_scope(method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]]) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": query, "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}


async def call(app, scope: dict, body: bytes) -> AsyncIterator[dict | bytes]:
    """Yield ``{"status": int, "headers": [(bytes, bytes)]}`` once, then the body's chunks."""
    out: asyncio.Queue = asyncio.Queue()
    sent_body = False
    gone = asyncio.Event()

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()  # the app polls for a disconnect: there is none until we are closed
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            out.put_nowait({"status": message["status"], "headers": list(message.get("headers", []))})
        elif message["type"] == "http.response.body":
            if message.get("body"):
                out.put_nowait(bytes(message["body"]))
            if not message.get("more_body", False):
                out.put_nowait(_END)

    async def run():
        try:
            await app(scope, receive, send)
        except Exception as e:  # the app's own error handlers answer first; this is a last resort
            out.put_nowait(e)
        finally:
            out.put_nowait(_END)

    task = asyncio.ensure_future(run())
    try:
        while True:
            item = await out.get()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        gone.set()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class Lifespan:
    """The app's lifespan protocol: ``await startup()`` before serving, ``await shutdown()`` after."""

    def __init__(self, app):
        self.app = app
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._task = None

    async def _send(self, message):
        self._outbox.put_nowait(message)

    async def startup(self) -> None:
        self._task = asyncio.ensure_future(self.app({"type": "lifespan", "asgi": {"version": "3.0"}},
                                                    self._inbox.get, self._send))
        self._inbox.put_nowait({"type": "lifespan.startup"})
        reply = await self._outbox.get()
        if reply["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app failed to start: {reply.get('message', reply['type'])}")

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        self._inbox.put_nowait({"type": "lifespan.shutdown"})
        await self._outbox.get()
        await self._task
