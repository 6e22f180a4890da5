"""The OpenAI-compatible HTTP app over one AsyncLLM, and ``serve`` to run it with uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``, ``GET /openapi.json`` (the request bodies are
the ``protocol`` models). Every error body is OpenAI's
``{"error": {"message", "type", "param", "code"}}``; unknown routes get it too.

If the engine thread stops serving (``AsyncLLM.error``), /health answers 503 and
``on_engine_death`` is called; ``serve`` then shuts uvicorn down and returns
``EXIT_ENGINE_DEAD``, so a supervisor restarts the process instead of it
answering 503 forever.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinyserve_trt.runtime.async_llm import AsyncLLM
from tinyserve_trt.runtime.server.admission import Admission
from tinyserve_trt.runtime.server.auth import ApiKeyMiddleware, bind_warning
from tinyserve_trt.runtime.server.config import ServerConfig
from tinyserve_trt.runtime.server.errors import APIError, error_body
from tinyserve_trt.runtime.server.handler import ENGINE_UNAVAILABLE, CompletionHandler
from tinyserve_trt.runtime.server.hosts import HostAllowList, HostMiddleware
from tinyserve_trt.runtime.server.metrics import ServerMetrics
from tinyserve_trt.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from tinyserve_trt.runtime.server.render import Renderer
from tinyserve_trt.runtime.server.warmup import prefill, render_token_ids

log = logging.getLogger("tinyserve.server")
EXIT_ENGINE_DEAD = 3  # the process exit status when the engine could not recover
WATCH_INTERVAL = 0.2  # seconds between two looks at the engine thread


def _body(model) -> dict:
    """``openapi_extra`` declaring ``model`` as the JSON request body (the route reads the body
    itself, so the limits of ``body.py`` apply before validation)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema plus the request models (and the models they use) as components."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (CompletionRequest, ChatCompletionRequest):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
        app.openapi_schema = schema
    return app.openapi_schema


async def _render_warmup(package_dir, config: ServerConfig, items: Sequence[dict]) -> list[list[int]]:
    renderer = Renderer.from_config(package_dir, config)
    try:
        return await render_token_ids(renderer, items)
    finally:
        await renderer.close()


def create_app(llm: AsyncLLM, config: ServerConfig = ServerConfig(), *, shutdown_engine: bool = True,
               on_engine_death: Callable[[], None] | None = None, warmup: Sequence[Sequence[int]] = ()) -> FastAPI:
    """An app serving ``llm``; with ``shutdown_engine`` the app's shutdown stops the engine thread.
    ``on_engine_death()`` is called (on the event loop) once the engine thread has failed.
    ``warmup``: prompt token ids prefilled into the prefix cache at startup, before the
    app answers anything (``warmup.prefill``)."""
    model_name = config.model_name or llm.package.path.resolve().name
    metrics = ServerMetrics()
    admission = Admission(llm.engine.config.max_batch + config.max_queue)
    renderer = Renderer.from_config(llm.package.path, config)
    handler = CompletionHandler(llm, config, model_name, metrics, admission, renderer)
    created = int(time.time())

    async def watch_engine():
        while llm.is_alive:
            await asyncio.sleep(WATCH_INTERVAL)
        if llm.error is not None:
            log.critical("the engine cannot recover (%r): /health answers 503; stopping the server", llm.error)
            if on_engine_death is not None:
                on_engine_death()

    @asynccontextmanager
    async def lifespan(app):
        watcher = asyncio.ensure_future(watch_engine())
        try:
            if warmup:
                tokens = await prefill(llm, warmup, handler.context)
                log.info("warm-up: %d prompts (%d tokens) prefilled into the prefix cache", len(warmup), tokens)
            yield
        finally:
            watcher.cancel()
            await renderer.close()
            if shutdown_engine:
                llm.shutdown()

    app = FastAPI(title="tinyserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.openapi = lambda: _openapi(app)
    app.state.llm, app.state.metrics, app.state.admission = llm, metrics, admission
    app.state.context = handler.context  # longest prompt + completion, in tokens
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, key=config.api_key)
    app.add_middleware(HostMiddleware, allowed=HostAllowList.from_config(config))  # outermost: before the key

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e):
        return JSONResponse(error_body(400, str(e)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e):
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(request, e):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}"), status_code=500)

    @app.post("/v1/completions", openapi_extra=_body(CompletionRequest))
    async def completions(request: Request):
        return await handler(request, "completion")

    @app.post("/v1/chat/completions", openapi_extra=_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await handler(request, "chat")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "tinyserve", "max_model_len": handler.context}]}

    @app.get("/health")
    async def health():
        if not llm.is_alive:  # the details are in the log (watch_engine); the client gets the class
            why = f" ({type(llm.error).__name__})" if llm.error is not None else ""
            return JSONResponse(error_body(503, f"the engine thread is not running{why}"), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text():
        try:
            stats, waiting, running = await llm.run_on_engine(
                lambda e: (e.stats(), len(e.scheduler.waiting), len(e.scheduler.running)))
        except RuntimeError as e:
            log.error("/metrics: the engine did not answer: %s", e)
            return JSONResponse(error_body(503, ENGINE_UNAVAILABLE), status_code=503)
        return PlainTextResponse(metrics.render(stats, waiting, running, admission.in_flight, admission.sequences),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def serve(model_dir, config: ServerConfig = ServerConfig(), *, log_level: str = "info", warmup: Sequence[dict] = (),
          **engine_config) -> int:
    """Load the package, then serve it until interrupted (blocks). ``engine_config``: EngineConfig's
    fields; ``warmup``: items of ``warmup.load_warmup`` prefilled before serving. Returns the
    process exit status: 0, or EXIT_ENGINE_DEAD when the engine failed."""
    import uvicorn

    warning = bind_warning(config.host, config.api_key)
    if warning:
        log.warning(warning)
        print(warning, file=sys.stderr, flush=True)
    llm = AsyncLLM(model_dir, **engine_config)
    try:  # the package's template renders in a worker, under the server's limits, as requests do
        warmup_ids = asyncio.run(_render_warmup(llm.package.path, config, warmup)) if warmup else []
    except ValueError:
        llm.shutdown()
        raise
    server: uvicorn.Server | None = None

    def stop():
        server.should_exit = True

    app = create_app(llm, config, on_engine_death=stop, warmup=warmup_ids)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                                           timeout_graceful_shutdown=config.graceful_shutdown))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal it handled (as uvicorn.run swallows it)
        pass
    return EXIT_ENGINE_DEAD if llm.error is not None else 0
