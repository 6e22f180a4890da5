"""The OpenAI-compatible HTTP server (``tinyserve serve``): FastAPI + uvicorn over one AsyncLLM.

Needs the ``serve`` extra (fastapi, uvicorn). ``create_app(AsyncLLM(...), ServerConfig(...))``
gives the ASGI app; ``serve(model_dir, ServerConfig(...), **engine_config)`` runs it.
``ServerConfig`` imports without fastapi (the CLI reads its defaults); the rest loads on
first access. ``auth`` (API key), ``hosts`` (the Host allow-list), ``render`` (chat templates
and tokenizing in worker processes, under limits), ``warmup`` (prefix-cache warm-up); scale-out on Ray Serve
(the ``scale`` extra): ``ray_app`` (ScaleConfig, deploy), ``ray_ingress``, ``ray_replica``,
``router`` (prefix-aware RequestRouter), ``ray_metrics``, ``asgi`` - see docs/scale_out.md.
"""

from tinyserve_trt.runtime.server.config import ServerConfig


def __getattr__(name):
    if name in ("create_app", "serve"):
        from tinyserve_trt.runtime.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'tinyserve_trt.runtime.server' has no attribute {name!r}")


__all__ = ["ServerConfig", "create_app", "serve"]
