"""The Host headers a server answers to: ``HostAllowList`` and ``HostMiddleware`` (421 otherwise).

Why: a key-less server on loopback is still reachable from any web page the user opens.
A page cannot read a cross-origin answer, but with DNS rebinding its own name
(``attacker.example``) is made to resolve to 127.0.0.1, and then the browser treats the
server as same-origin. The browser still sends ``Host: attacker.example``: refusing
Host names the server was not configured for closes that door (as Jupyter and the
Docker and Kubernetes dashboards do). The allowed names are

* loopback: ``localhost`` and any loopback IP literal (``127.0.0.1``, ``[::1]``),
* the bound host (``ServerConfig.host``) unless it is a wildcard (``0.0.0.0``, ``::``),
* ``ServerConfig.allowed_hosts`` (``--allowed-host``): a name, an IP literal,
  ``*.suffix`` (any name under ``suffix``), or ``*`` (any Host: the check is off),

each with any port. A request without a Host header passes: browsers always send one
(in-process calls such as a Ray replica's own ``/metrics`` read do not). ``/health``
is not checked, so probes that address the server by a pod IP keep working; it
answers nothing a page could use. The check runs before the API key and the body.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable

from tinyserve_trt.runtime.server.auth import OPEN_PATHS
from tinyserve_trt.runtime.server.errors import error_body

__all__ = ["OPEN_PATHS", "HostAllowList", "HostMiddleware", "host_header", "host_name", "misdirected_body"]
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", "*"})


def host_name(header: str) -> str | None:
    """The lower-case name of a ``Host`` header without its port (``[::1]:80`` -> ``::1``);
    None when it is malformed (a non-numeric port, an unclosed bracket)."""
    value = header.strip().lower()
    if value.startswith("["):
        name, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return name
    if value.count(":") == 1:
        value, port = value.split(":")
        if not port.isdigit():
            return None
    return value.rstrip(".") or None


def _is_loopback_ip(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class HostAllowList:
    """Host names (and ``*.suffix`` patterns) a server answers to; see the module docstring."""

    def __init__(self, patterns: Iterable[str]):
        self.any = False
        self.names: set[str] = {"localhost"}
        self.suffixes: list[str] = []
        for p in patterns:
            p = p.strip().lower().rstrip(".")
            if p == "*":
                self.any = True
            elif p.startswith("*."):
                self.suffixes.append(p[1:])  # ".svc.example"
            else:
                self.names.add(p[1:-1] if p.startswith("[") and p.endswith("]") else p)

    @classmethod
    def from_config(cls, config) -> HostAllowList:
        """Loopback, ``config.host`` unless a wildcard, and ``config.allowed_hosts``."""
        bound = [] if config.host.strip("[]") in WILDCARD_BINDS else [config.host]
        return cls([*bound, *config.allowed_hosts])

    def allows(self, header: str | None) -> bool:
        """Whether a request with this ``Host`` header value is served (None: no header)."""
        if header is None or self.any:
            return True
        name = host_name(header)
        if name is None:
            return False
        return name in self.names or _is_loopback_ip(name) or any(name.endswith(s) for s in self.suffixes)


def host_header(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The ``Host`` header of ASGI raw headers (latin-1, as HTTP carries it), or None."""
    for name, value in headers:
        if name.lower() == b"host":
            return value.decode("latin-1")
    return None


def misdirected_body() -> dict:
    return error_body(421, "this server does not answer to the Host this request names; add it with "
                           "--allowed-host if it is yours", code="misdirected_request")


class HostMiddleware:
    """Wraps an ASGI app: HTTP requests outside ``OPEN_PATHS`` whose Host is not allowed get
    421 in OpenAI's error shape before anything reads their body."""

    def __init__(self, app, allowed: HostAllowList):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        header = host_header(scope.get("headers", []))
        if self.allowed.allows(header):
            return await self.app(scope, receive, send)
        body = json.dumps(misdirected_body()).encode()
        await send({"type": "http.response.start", "status": 421, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
