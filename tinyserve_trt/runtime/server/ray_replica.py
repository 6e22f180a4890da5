"""EngineReplica: one Ray Serve replica = one AsyncLLM (its own page pool) + the single server's app.

Requests arrive as method calls from the ingress (``http``) and run through the very
app ``tinyserve serve`` runs (``create_app``: routes, errors, limits, admission,
timeouts, metrics) in-process via ``asgi.call``; answers stream back chunk by chunk
with an ``x-tinyserve-replica`` header naming the replica. Every method takes the
router's kwargs (``route_key``, ``replica``), which the router reads and the method
ignores. A dead engine ends the process (``EXIT_ENGINE_DEAD``) and ``check_health``
fails, so Ray Serve replaces the replica.
"""

from __future__ import annotations

import os
from dataclasses import replace

from tinyserve_trt.runtime.server.config import ServerConfig

REPLICA_HEADER = b"x-tinyserve-replica"


class EngineReplica:
    """One engine and the single server's app, answering forwarded requests."""

    async def __init__(self, model_dir: str, config: ServerConfig, engine: dict):
        from ray import serve

        from tinyserve_trt.runtime.async_llm import AsyncLLM
        from tinyserve_trt.runtime.server.app import EXIT_ENGINE_DEAD, create_app
        from tinyserve_trt.runtime.server.asgi import Lifespan

        self.id = serve.get_replica_context().replica_id.unique_id
        self.llm = AsyncLLM(model_dir, **engine)
        # the ingress checked the key; a dead engine ends the process so Ray replaces it
        self.app = create_app(self.llm, replace(config, api_key=None),
                              on_engine_death=lambda: os._exit(EXIT_ENGINE_DEAD))
        self.lifespan = Lifespan(self.app)
        await self.lifespan.startup()

    async def http(self, method: str, path: str, query: bytes, headers: list, body: bytes,
                   route_key: str | None = None, replica: str | None = None):
        """The app's answer: ``{"status", "headers"}``, then body chunks (bytes)."""
        from tinyserve_trt.runtime.server.asgi import call, http_scope

        async for item in call(self.app, http_scope(method, path, query, headers), body):
            if isinstance(item, dict):
                item["headers"].append((REPLICA_HEADER, self.id.encode()))
            yield item

    async def _get(self, path: str) -> tuple[int, bytes]:
        from tinyserve_trt.runtime.server.asgi import call, http_scope

        status, chunks = 500, []
        async for item in call(self.app, http_scope("GET", path, b"", []), b""):
            if isinstance(item, dict):
                status = item["status"]
            else:
                chunks.append(item)
        return status, b"".join(chunks)

    async def metrics(self, replica: str | None = None) -> tuple[str, int, str]:
        status, body = await self._get("/metrics")
        return self.id, status, body.decode()

    async def health(self, replica: str | None = None) -> tuple[str, int, str]:
        status, body = await self._get("/health")
        return self.id, status, body.decode()

    async def warmup(self, token_ids: list[int], route_key: str | None = None, replica: str | None = None) -> str:
        from tinyserve_trt.runtime.server.warmup import prefill

        await prefill(self.llm, [token_ids], self.app.state.context)
        return self.id

    async def stats(self, replica: str | None = None) -> dict:
        """Engine counters and stats, the process id and this replica's id (tests, benchmark)."""
        return await self.llm.run_on_engine(lambda e: {**e.stats(), **e.counters, "pid": os.getpid(), "id": self.id})

    def check_health(self):
        if not self.llm.is_alive:
            raise RuntimeError(f"the engine thread is not running ({self.llm.error!r})")

    def __del__(self):  # Ray Serve stopping the replica: free the engine (its thread and pool)
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()
