"""Ingress: the fleet's HTTP front (one Ray Serve deployment, no engine), a thin forwarder.

Per request: the Host allow-list (421), the API key (401) and a POST's media type
(``application/json``, else 415), all before the body is read -> body, within
``body_timeout_s`` (408) and up to ``max_body_bytes`` + 1
(the replica answers the 400 of a larger one) -> routing key from the prompt's first
pages (the chat template and the tokenizer run in ``render.Renderer`` workers, with the
server's limits, never on the event loop) -> one EngineReplica through the DeploymentHandle (its RequestRouter reads the
key) -> the replica's status, headers and body chunks, streamed through. A replica
that fails before answering gives 503; one that fails mid-stream ends an SSE stream
with an OpenAI error event and ``[DONE]`` (the openai client raises it), so no client
hangs. ``/metrics`` merges every live replica's metrics; ``/health`` asks one replica.
"""

from __future__ import annotations

import asyncio
import json
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tinyserve_trt.runtime.server.auth import bearer_token, key_matches, unauthorized_body
from tinyserve_trt.runtime.server.body import body_timeout, is_json_media_type, unsupported_media_type
from tinyserve_trt.runtime.server.config import ServerConfig
from tinyserve_trt.runtime.server.errors import APIError, error_body
from tinyserve_trt.runtime.server.hosts import OPEN_PATHS, HostAllowList, host_header, misdirected_body

log = logging.getLogger("tinyserve.ray")
CALL_TIMEOUT = 10.0  # seconds for a control call (metrics, health, stats) to one replica
WARMUP_TIMEOUT = 600.0  # seconds for one warm-up prefill
_HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}


def _sse_error(message: str) -> bytes:
    body = json.dumps(error_body(503, message, code="replica_failed"))
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()


class Ingress:
    def __init__(self, engine, model_dir: str, config: ServerConfig, route_pages: int, engine_name: str):
        from tinyserve_trt.runtime.model_package import ModelPackage

        self.engine, self.config, self.route_pages, self.engine_name = engine, config, route_pages, engine_name
        self.hosts = HostAllowList.from_config(config)
        from tinyserve_trt.runtime.server.render import Renderer, longest_token_chars

        self.package = ModelPackage.load(model_dir)  # tokenizer + chat template for routing keys
        self.renderer = Renderer.from_config(model_dir, config)
        self.max_chars = self.package.max_context * (longest_token_chars(self.package) or 1)

    async def __call__(self, request: Request):
        path = request.url.path
        headers = request.scope.get("headers", [])
        if path not in OPEN_PATHS and not self.hosts.allows(host_header(headers)):  # as the app's HostMiddleware
            return JSONResponse(misdirected_body(), status_code=421)
        if self.config.api_key is not None and path not in OPEN_PATHS:
            token = bearer_token(headers)
            if not key_matches(token, self.config.api_key):
                return JSONResponse(unauthorized_body(token), status_code=401, headers={"www-authenticate": "Bearer"})
        if request.method == "POST" and not is_json_media_type(request.headers.get("content-type")):
            return unsupported_media_type().response()
        try:
            if request.method == "GET" and path == "/metrics":
                return await self._metrics()
            if request.method == "GET" and path == "/health":
                return await self._health()
            return await self._forward(request, path)
        except Exception as e:  # still OpenAI's error shape, never Serve's plain-text 500
            log.exception("ingress error on %s", path)
            return JSONResponse(error_body(500, f"internal error: {type(e).__name__}"), status_code=500)

    # ---- forwarding --------------------------------------------------------------------
    async def _body(self, request: Request) -> bytes:
        limit, chunks, size = self.config.max_body_bytes + 1, [], 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size >= limit:
                break
        return b"".join(chunks)[:limit]

    async def _body_in_time(self, request: Request) -> bytes:
        try:
            return await asyncio.wait_for(self._body(request), self.config.body_timeout_s)
        except asyncio.TimeoutError:
            raise body_timeout(self.config.body_timeout_s) from None

    async def _route_key(self, path: str, body: bytes) -> str | None:
        """The body's routing key (``router.route_key`` of its first prompt), or None when it
        has none or it cannot be rendered / tokenized (the replica answers that request)."""
        from tinyserve_trt.runtime.server.render import RenderError
        from tinyserve_trt.runtime.server.router import route_key, route_prompt

        found = route_prompt(path, body)
        if found is None:
            return None
        kind, value = found
        try:
            if kind == "messages":
                ids = await self.renderer.chat(value, self.max_chars)
            elif kind == "text":
                (ids,) = await self.renderer.encode([value], self.max_chars)
            else:
                ids = value
        except RenderError:
            return None
        return route_key(ids, self.package.page_size, self.route_pages)

    async def _forward(self, request: Request, path: str):
        try:
            body = await self._body_in_time(request)
        except APIError as e:
            return e.response()
        key = await self._route_key(path, body) if request.method == "POST" else None
        headers = [(k, v) for k, v in request.scope.get("headers", []) if k.lower() != b"authorization"]
        for attempt in range(2):  # a replica that died before answering: once more, on a live one
            stream = self.engine.options(stream=True).http.remote(
                request.method, path, request.scope.get("query_string", b""), headers, body, route_key=key)
            try:
                start = await stream.__anext__()
                break
            except Exception as e:
                stream.cancel()
                log.warning("no answer from a replica for %s (attempt %d): %r", path, attempt + 1, e)
                error = e
        else:
            return JSONResponse(error_body(503, f"no replica could serve the request ({type(error).__name__})",
                                           code="replica_failed"), status_code=503)
        is_sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start["headers"])

        async def chunks():
            done = False
            try:
                async for chunk in stream:
                    yield chunk
                done = True
            except Exception as e:  # the replica died or was cut off mid-answer
                done = True
                log.warning("replica failed mid-answer on %s: %r", path, e)
                if is_sse:
                    yield _sse_error(f"the replica serving this stream failed ({type(e).__name__}); retry")
            finally:
                if not done:  # the client left: cancel the replica's call (it aborts the request)
                    stream.cancel()

        response = StreamingResponse(chunks(), status_code=start["status"])
        response.raw_headers = [(k, v) for k, v in start["headers"] if k.lower() not in _HOP_HEADERS]
        return response

    # ---- fleet views -----------------------------------------------------------------
    # Calls made while serving one request share its internal request id, and Ray Serve's
    # router matches a routed replica to its pending call by that id: concurrent calls from
    # one request can swap replicas or wait forever. So the fan-outs go one call at a time.
    async def _each(self, method: str) -> list:
        answers = []
        for rid in await self.replica_ids():
            try:
                answers.append(await self._call(method, replica=rid))
            except Exception as e:  # a replica dying now; the others still answer
                answers.append(e)
        return answers

    async def _call(self, method: str, timeout: float = CALL_TIMEOUT, **kwargs):
        async def go():
            return await getattr(self.engine, method).remote(**kwargs)
        return await asyncio.wait_for(go(), timeout)

    async def replica_ids(self) -> list[str]:
        from tinyserve_trt.runtime.server.router import LIVE_REPLICAS

        if not LIVE_REPLICAS.get(self.engine_name):  # the router starts with the first call
            await self._call("health")
        return list(LIVE_REPLICAS.get(self.engine_name, []))

    async def _metrics(self):
        from tinyserve_trt.runtime.server.ray_metrics import merge

        answers = await self._each("metrics")
        texts = {a[0]: a[2] for a in answers if not isinstance(a, BaseException) and a[1] == 200}
        if not texts:  # the client gets class names and statuses; the errors themselves go to the log
            for a in answers:
                if isinstance(a, BaseException):
                    log.warning("a replica did not answer /metrics: %r", a)
            why = "; ".join(sorted({type(a).__name__ if isinstance(a, BaseException) else f"status {a[1]}"
                                    for a in answers}))
            return JSONResponse(error_body(503, f"no replica answered /metrics ({why or 'no replicas'})",
                                           code="replica_failed"), status_code=503)
        return PlainTextResponse(merge(texts), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _health(self):
        try:
            rid, status, body = await self._call("health")
        except Exception as e:
            return JSONResponse(error_body(503, f"no replica is healthy ({type(e).__name__})"), status_code=503)
        return JSONResponse(json.loads(body), status_code=status, headers={"x-tinyserve-replica": rid})

    async def warmup(self, items: list[dict]) -> dict[str, int]:
        """Prefill each warm-up item on the replica that owns its first pages; replica id -> count.

        A prefix of fewer than ``route_pages`` full pages is prefilled on every replica: the
        requests that extend it hash more pages than it has, so their owner is not its owner."""
        from tinyserve_trt.runtime.server.router import route_key
        from tinyserve_trt.runtime.server.warmup import render_token_ids

        owners: dict[str, int] = {}
        for ids in await render_token_ids(self.renderer, items):
            if len(ids) // self.package.page_size < self.route_pages:
                targets = [dict(replica=rid) for rid in await self.replica_ids()]
            else:
                targets = [dict(route_key=route_key(ids, self.package.page_size, self.route_pages))]
            for target in targets:
                rid = await self._call("warmup", WARMUP_TIMEOUT, token_ids=ids, **target)
                owners[rid] = owners.get(rid, 0) + 1
        return owners

    async def stats(self) -> dict[str, dict]:
        """Replica id -> its engine stats, for every replica the router sees (tests, benchmark);
        raises what a replica's call raised."""
        answers = await self._each("stats")
        for a in answers:
            if isinstance(a, BaseException):
                raise a
        return {a["id"]: a for a in answers}

    def __del__(self):  # Ray Serve stopping the ingress: its render workers go with it
        renderer = getattr(self, "renderer", None)
        if renderer is not None:
            renderer.kill()
