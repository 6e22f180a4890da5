"""The OpenAI-compatible HTTP app over one AsyncLLM, and ``serve`` to run it with uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``. Every error body is OpenAI's
``{"error": {"message", "type", "param", "code"}}``; unknown routes get it too.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinyserve_trt.runtime.async_llm import AsyncLLM
from tinyserve_trt.runtime.server.admission import Admission
from tinyserve_trt.runtime.server.config import ServerConfig
from tinyserve_trt.runtime.server.errors import APIError, error_body
from tinyserve_trt.runtime.server.handler import CompletionHandler
from tinyserve_trt.runtime.server.metrics import ServerMetrics

log = logging.getLogger("tinyserve.server")


def create_app(llm: AsyncLLM, config: ServerConfig = ServerConfig(), *, shutdown_engine: bool = True) -> FastAPI:
    """An app serving ``llm``; with ``shutdown_engine`` the app's shutdown stops the engine thread."""
    model_name = config.model_name or llm.package.path.resolve().name
    metrics = ServerMetrics()
    admission = Admission(llm.engine.config.max_batch + config.max_queue)
    handler = CompletionHandler(llm, config, model_name, metrics, admission)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        yield
        if shutdown_engine:
            llm.shutdown()

    app = FastAPI(title="tinyserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.llm, app.state.metrics, app.state.admission = llm, metrics, admission

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

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handler(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handler(request, "chat")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "tinyserve", "max_model_len": handler.context}]}

    @app.get("/health")
    async def health():
        if not llm.is_alive:
            return JSONResponse(error_body(503, "the engine thread is not running"), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text():
        try:
            stats, waiting, running = await llm.run_on_engine(
                lambda e: (e.stats(), len(e.scheduler.waiting), len(e.scheduler.running)))
        except RuntimeError as e:
            return JSONResponse(error_body(503, str(e)), status_code=503)
        return PlainTextResponse(metrics.render(stats, waiting, running, admission.in_flight),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def serve(model_dir, config: ServerConfig = ServerConfig(), *, log_level: str = "info", **engine_config) -> None:
    """Load the package, then serve it until interrupted (blocks). ``engine_config``: EngineConfig's fields."""
    import uvicorn

    llm = AsyncLLM(model_dir, **engine_config)
    app = create_app(llm, config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=log_level,
                timeout_graceful_shutdown=config.graceful_shutdown)
