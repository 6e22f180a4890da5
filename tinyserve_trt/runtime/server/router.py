"""Prefix-aware request routing for Ray Serve replicas, on Ray Serve's ``RequestRouter`` extension point.

The routing key of a request is the chained page hash (``prefix_cache.compute_hash``,
the prefix cache's own key) of its first ``route_pages`` full pages: requests that share
those pages share a key. The key's owner among the live replicas is chosen by
rendezvous hashing (highest ``blake2b(key, replica id)``), so every router process
agrees without shared state, and a replica joining or leaving moves only its own keys.

Bounded by load: the owner is preferred while its queue is within ``imbalance`` of the
least loaded other replica; past that, power of two choices between the owner and one
random other (Ray Serve then takes the one with the shorter queue). A full owner falls
through to the other replicas. Requests without a key (shorter than a page, or a body
the key could not be read from) get plain power of two choices.

Both routers also honour ``replica=<unique id>`` in a call's kwargs (the ingress uses it
to read each replica's /metrics) and record the replica ids they see in ``LIVE_REPLICAS``
(per deployment, per process), which the ingress reads.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import random

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import RequestRouter

from tinyserve_trt.runtime.prefix_cache import compute_hash

LIVE_REPLICAS: dict[str, list[str]] = {}  # deployment name -> unique ids of the replicas routable now
DEFAULT_IMBALANCE = 4


def route_key(token_ids, page_size: int, route_pages: int) -> str | None:
    """Hex chained hash of the first ``min(route_pages, full pages)`` pages; None under one page."""
    n = min(route_pages, len(token_ids) // page_size)
    parent = None
    for i in range(n):
        parent = compute_hash(token_ids[i * page_size:(i + 1) * page_size], parent)
    return None if parent is None else parent.hex()


def route_prompt(path: str, body: bytes) -> tuple[str, object] | None:
    """What picks the replica of an OpenAI request body: ``("messages", [...])`` (chat, to
    render with the chat template), ``("text", str)`` or ``("ids", [int])`` (completions:
    the first prompt); None when there is none to read. Parses only - the caller renders
    and tokenizes off its event loop (``render.Renderer``). Never raises: a body the
    replica will refuse needs no particular replica."""
    try:
        obj = json.loads(body)
        if path.endswith("/chat/completions"):
            messages = [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
                        for m in obj["messages"]]
            if not all(isinstance(m["role"], str) and isinstance(m["content"], str) for m in messages):
                return None
            return "messages", messages
        if path.endswith("/completions"):
            prompt = obj["prompt"]
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # a list of prompts: the first one picks the replica
            if isinstance(prompt, str):
                return "text", prompt
            if isinstance(prompt, list) and all(type(t) is int for t in prompt):
                return "ids", prompt
        return None
    except Exception:
        return None


def rendezvous_order(key: str, replica_ids: list[str]) -> list[str]:
    """``replica_ids`` by decreasing rendezvous score for ``key``: the first is the owner."""
    def score(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}/{rid}".encode(), digest_size=8).digest()
    return sorted(replica_ids, key=score, reverse=True)


class _Tracking:
    """Replica targeting (``replica=`` kwarg) and the ``LIVE_REPLICAS`` record."""

    def update_replicas(self, replicas):
        super().update_replicas(replicas)
        # Ray Serve may unpickle this class by value (with a copy of this module's globals):
        # write to the imported module's record, which the ingress reads
        live = importlib.import_module("tinyserve_trt.runtime.server.router").LIVE_REPLICAS
        live[self._deployment_id.name] = sorted(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        live = importlib.import_module("tinyserve_trt.runtime.server.router").LIVE_REPLICAS
        live[self._deployment_id.name] = sorted(r.unique_id for r in self._replicas)

    def _target(self, candidates, pending):
        target = None if pending is None else pending.kwargs.get("replica")
        if target is None:
            return None
        return [[r for r in candidates if r.replica_id.unique_id == target]]


class PrefixAwareRouter(_Tracking, RequestRouter):
    """Owner of the request's leading pages first, power of two choices when it is busy."""

    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, **kwargs):
        if not isinstance(imbalance, int) or imbalance < 1:
            raise ValueError(f"imbalance must be an int >= 1, got {imbalance!r}")
        self.imbalance = imbalance

    def _queue(self, replica) -> int | None:
        return self.replica_queue_len_cache.get(replica.replica_id)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        targeted = self._target(candidate_replicas, pending_request)
        if targeted is not None:
            return targeted
        key = None if pending_request is None else pending_request.kwargs.get("route_key")
        if len(candidate_replicas) < 2:
            return [list(candidate_replicas)]
        if key is None:
            return [random.sample(candidate_replicas, 2)]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = [by_id[i] for i in rendezvous_order(key, list(by_id))]
        owner, others = order[0], order[1:]
        owner_q = self._queue(owner)
        known = [q for q in map(self._queue, others) if q is not None]
        if owner_q is not None and known and owner_q - min(known) >= self.imbalance:
            return [[owner, random.choice(others)], others]  # busy owner: the shorter queue of two
        return [[owner], others]


class DefaultRouter(_Tracking, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default routing (power of two choices, locality) plus replica targeting:
    the baseline ``bench_scale.py`` compares against."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        targeted = self._target(candidate_replicas, pending_request)
        if targeted is not None:
            return targeted
        return await super().choose_replicas(candidate_replicas, pending_request)


ROUTERS = {"prefix": PrefixAwareRouter, "default": DefaultRouter}
