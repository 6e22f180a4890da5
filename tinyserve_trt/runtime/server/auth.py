"""API-key authentication: ``Authorization: Bearer KEY`` on every route but ``/health``.

``ApiKeyMiddleware`` is plain ASGI (no body buffering, streaming untouched): a request
without the right key is answered 401 in OpenAI's error shape before the app reads
its body, so nothing is tokenized, queued or generated for it. The comparison is
``hmac.compare_digest`` over the UTF-8 bytes (constant time in the key's content).
``bind_warning`` is the line a server prints when it listens beyond loopback with no key.
"""

from __future__ import annotations

import hmac
import ipaddress
import json

from tinyserve_trt.runtime.server.errors import error_body

OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no credentials
ENV_VAR = "TINYSERVE_API_KEY"


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the first ``Authorization: Bearer <token>`` header (ASGI raw headers)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


def key_matches(token: bytes | None, key: str) -> bool:
    """Constant-time equality of ``token`` with ``key`` (False for a missing token)."""
    return token is not None and hmac.compare_digest(token, key.encode("utf-8"))


def unauthorized_body(token: bytes | None) -> dict:
    message = ("missing API key: send 'Authorization: Bearer <key>'" if token is None
               else "incorrect API key provided")
    return error_body(401, message, code="invalid_api_key")


class ApiKeyMiddleware:
    """Wraps an ASGI app; HTTP requests outside ``OPEN_PATHS`` need the key (lifespan passes)."""

    def __init__(self, app, key: str):
        if not isinstance(key, str) or not key:
            raise ValueError("the API key must be a non-empty string")
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        token = bearer_token(scope.get("headers", []))
        if key_matches(token, self.key):
            return await self.app(scope, receive, send)
        body = json.dumps(unauthorized_body(token)).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def bind_warning(host: str, api_key: str | None) -> str | None:
    """A warning when ``host`` is reachable from other machines and no key guards it."""
    if api_key or is_loopback(host):
        return None
    return (f"WARNING: serving on {host} without an API key: anyone who can reach this address can use "
            f"the model; pass --api-key (or set {ENV_VAR})")
