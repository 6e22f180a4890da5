"""The OpenAI-compatible HTTP server (``tinyserve serve``): FastAPI + uvicorn over one AsyncLLM.

Needs the ``serve`` extra (fastapi, uvicorn). ``create_app(AsyncLLM(...), ServerConfig(...))``
gives the ASGI app; ``serve(model_dir, ServerConfig(...), **engine_config)`` runs it.
"""

from tinyserve_trt.runtime.server.app import create_app, serve
from tinyserve_trt.runtime.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app", "serve"]
