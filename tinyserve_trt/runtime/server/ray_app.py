"""``tinyserve serve --replicas N``: N engine replicas on Ray Serve behind one OpenAI-compatible API.

    HTTP -> Ray Serve proxy -> Ingress (1 process, no engine) -> EngineReplica x N (one process each)

Each ``EngineReplica`` loads the package into its own AsyncLLM (its own page pool and
prefix cache) and runs the very app of the single server (``create_app``: the same
routes, errors, limits, 429 admission, timeouts, metrics) in-process through ``asgi.call``;
it adds an ``x-tinyserve-replica`` header naming itself. The ``Ingress`` is a thin
forwarder: it checks the Host, the API key and the media type, reads the body (up to
``max_body_bytes`` + 1: the replica answers the 400), computes the routing key from the
prompt's first pages (``router.route_prompt``, rendered in ``render.Renderer`` workers)
and calls a replica through a DeploymentHandle whose ``RequestRouter``
(``router.PrefixAwareRouter``) sees that key. Responses stream back
chunk by chunk. ``/metrics`` merges every replica's metrics (``ray_metrics.merge``);
``/health`` asks one replica.

Faults: a replica that dies mid-stream ends its streams with an OpenAI error event and
``[DONE]`` (a non-stream request gets a 503); the router stops sending to it and Ray
Serve starts a replacement (health checks: ``check_health`` fails once the engine
thread is dead, and a dead engine exits the process). ``shutdown`` deletes the app and
frees every replica (their engines close in ``__del__``).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from tinyserve_trt.runtime.limits import is_finite_number, is_int
from tinyserve_trt.runtime.server.config import ServerConfig

log = logging.getLogger("tinyserve.ray")
APP, ENGINE, INGRESS = "tinyserve", "TinyserveEngine", "TinyserveIngress"


@dataclass(frozen=True)
class ScaleConfig:
    """How ``serve`` spreads over Ray.

    replicas:     engine replicas (one process each, each with its own KV page pool).
    ray_address:  an existing cluster to join (``ray start --head`` printed it; "auto" finds
                  a local one); None starts a local cluster on this machine.
    routing:      "prefix" (the owner of the prompt's first pages, load-bounded) or "default"
                  (Ray Serve's power of two choices; the baseline).
    route_pages:  leading full pages whose chained hash is the routing key.
    imbalance:    queue-length gap past which a busy owner shares with a random replica.
    replica_cpus, replica_gpus: Ray resources reserved per engine replica.
    """

    replicas: int = 2
    ray_address: str | None = None
    routing: str = "prefix"
    route_pages: int = 4
    imbalance: int = 4
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0

    def __post_init__(self):
        if not is_int(self.replicas) or self.replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {self.replicas!r}")
        if self.ray_address is not None and (not isinstance(self.ray_address, str) or not self.ray_address):
            raise ValueError(f"ray_address must be a non-empty string or None, got {self.ray_address!r}")
        if self.routing not in ("prefix", "default"):
            raise ValueError(f"routing must be 'prefix' or 'default', got {self.routing!r}")
        for name in ("route_pages", "imbalance"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("replica_cpus", "replica_gpus"):
            if not is_finite_number(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a number >= 0, got {getattr(self, name)!r}")


def deploy(model_dir: str, config: ServerConfig, scale: ScaleConfig, engine: dict,
           warmup: Sequence[dict] = (), *, num_cpus: int | None = None):
    """Deploy the fleet on Ray (joining ``scale.ray_address`` or starting a local cluster with
    ``num_cpus``), warm each replica's owned prefixes, and return the ingress handle.
    The API listens on ``config.host:config.port`` (Ray Serve's proxy)."""
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from tinyserve_trt.runtime.server.ray_ingress import Ingress
    from tinyserve_trt.runtime.server.ray_replica import EngineReplica
    from tinyserve_trt.runtime.server.router import ROUTERS

    if not ray.is_initialized():
        ray.init(address=scale.ray_address, num_cpus=None if scale.ray_address else num_cpus,
                 include_dashboard=False, logging_level=logging.WARNING)
    serve.start(http_options={"host": config.host, "port": config.port})
    # room beyond what the replica admits, so its own 429 (not Serve's queue) answers overload
    from tinyserve_trt.runtime.config import EngineConfig

    slots = EngineConfig(**engine).max_batch + config.max_queue + 8
    replica = serve.deployment(EngineReplica, name=ENGINE).options(
        num_replicas=scale.replicas, max_ongoing_requests=slots, max_queued_requests=-1,
        ray_actor_options={"num_cpus": scale.replica_cpus, "num_gpus": scale.replica_gpus},
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=config.graceful_shutdown,
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[scale.routing],
                                                  request_router_kwargs=dict(imbalance=scale.imbalance)
                                                  if scale.routing == "prefix" else {}))
    ingress = serve.deployment(Ingress, name=INGRESS).options(
        num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
    app = ingress.bind(replica.bind(str(model_dir), config, engine), str(model_dir), config,
                       scale.route_pages, ENGINE)
    handle = serve.run(app, name=APP, route_prefix="/")
    if warmup:
        owners = handle.warmup.remote(list(warmup)).result()
        log.info("warm-up: %d prompts prefilled on their owners %s", len(warmup), owners)
    return handle


def shutdown(*, keep_cluster: bool = False) -> None:
    """Free the fleet. ``keep_cluster``: on a cluster this process joined, delete only this
    application (other applications and Serve keep running); otherwise stop Ray Serve and
    disconnect (a local cluster this process started stops with it). Not connected (a deploy that
    failed before joining): nothing to free - Serve's API would start a local cluster to ask."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        if keep_cluster:
            serve.delete(APP)
        else:
            serve.shutdown()
    finally:
        ray.shutdown()


def run(model_dir: str, config: ServerConfig, scale: ScaleConfig, engine: dict, warmup: Sequence[dict] = ()) -> int:
    """``tinyserve serve --replicas N``: deploy, then serve until SIGINT/SIGTERM (blocks); 0 on a clean stop."""
    from tinyserve_trt.runtime.server.auth import bind_warning

    warning = bind_warning(config.host, config.api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        deploy(model_dir, config, scale, engine, warmup)
        print(f"tinyserve: serving {scale.replicas} replicas on http://{config.host}:{config.port}", flush=True)
        stop.wait()
    finally:
        shutdown(keep_cluster=scale.ray_address is not None)
    return 0
