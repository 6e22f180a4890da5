"""ServerConfig: what ``tinyserve serve`` adds on top of EngineConfig."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

from tinyserve_trt.runtime.limits import MAX_N, is_finite_number, is_int as _is_int


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side limits; validated here, the CLI takes its defaults from them.

    host, port:        where uvicorn listens (loopback by default).
    model_name:        the id clients pass as ``model``; None = the package directory's name.
    max_queue:         sequences allowed to wait beyond the engine's ``max_batch`` running ones;
                       the server holds at most ``max_batch + max_queue`` sequences and answers
                       429 to the next request (a request counts its prompts x ``n``; one that
                       could never fit is 400).
    timeout:           seconds a request may take from arrival to its last token; past it the
                       request is aborted (its pages freed) and answered 504. None = no limit.
    graceful_shutdown: seconds uvicorn waits for open requests on shutdown.
    max_n:             most samples per prompt (``n``) a request may ask for, at most
                       ``limits.MAX_N`` (OpenAI's 128); each sample is a sequence to decode.
    max_prompts:       most prompts in one ``/v1/completions`` request (a list of prompts).
    max_body_bytes:    largest request body; a larger one is answered 400 unread.
    body_timeout_s:    seconds a request body may take to arrive in full; past it, 408.
    max_json_depth:    deepest nesting of arrays/objects in a request body (OpenAI's bodies
                       need about 5); deeper is answered 400 before validation.
    api_key:           when set, every route but /health needs ``Authorization: Bearer <api_key>``
                       (401 otherwise); None = open. Kept out of the repr (logs).
    allowed_hosts:     Host header names served besides loopback and ``host`` (a non-wildcard
                       bind): names, IP literals, ``*.suffix``, or ``*`` (any Host); any port.
                       Other Hosts get 421 (DNS rebinding; see ``hosts.py``).
    render_workers:    worker processes that render chat templates and tokenize text
                       (``render.py``); more jobs wait for one.
    render_timeout_s:  seconds one render + tokenize may take; past it the worker is killed
                       and the request answered 400 (``render_timeout``).
    render_memory_bytes: memory a worker may allocate beyond what it holds after loading the
                       package (Linux ``RLIMIT_DATA``); past it the request is answered 400.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    max_queue: int = 256
    timeout: float | None = 600.0
    graceful_shutdown: float = 5.0
    max_n: int = 16
    max_prompts: int = 64
    max_body_bytes: int = 8 << 20
    max_json_depth: int = 32
    body_timeout_s: float = 30.0
    api_key: str | None = field(default=None, repr=False)
    allowed_hosts: tuple[str, ...] = ()
    render_workers: int = 2
    render_timeout_s: float = 2.0
    render_memory_bytes: int = 1 << 30

    def __post_init__(self):
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        if not _is_int(self.port) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {self.port!r}")
        if self.model_name is not None and (not isinstance(self.model_name, str) or not self.model_name):
            raise ValueError(f"model_name must be a non-empty string or None, got {self.model_name!r}")
        if not _is_int(self.max_queue) or self.max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {self.max_queue!r}")
        if self.timeout is not None and (not is_finite_number(self.timeout) or not self.timeout > 0):
            raise ValueError(f"timeout must be seconds > 0 or None, got {self.timeout!r}")
        for name in ("render_timeout_s", "body_timeout_s"):
            if not is_finite_number(getattr(self, name)) or not getattr(self, name) > 0:
                raise ValueError(f"{name} must be seconds > 0, got {getattr(self, name)!r}")
        if not is_finite_number(self.graceful_shutdown) or self.graceful_shutdown < 0:
            raise ValueError(f"graceful_shutdown must be seconds >= 0, got {self.graceful_shutdown!r}")
        if not _is_int(self.max_n) or not 1 <= self.max_n <= MAX_N:
            raise ValueError(f"max_n must be an int in [1, {MAX_N}], got {self.max_n!r}")
        for name in ("max_prompts", "max_body_bytes", "max_json_depth", "render_workers", "render_memory_bytes"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        key = self.api_key
        if key is not None and (not isinstance(key, str) or not key or key != key.strip()
                                or not (key.isascii() and key.isprintable())):
            raise ValueError("api_key must be a non-empty printable ASCII string without surrounding spaces, or None")
        if not isinstance(self.allowed_hosts, tuple) or not all(map(_is_host_pattern, self.allowed_hosts)):
            raise ValueError(f"allowed_hosts must be a tuple of host names, IP literals, '*.suffix' or '*' "
                             f"(no scheme, port or path), got {self.allowed_hosts!r}")


_HOST_NAME = re.compile(r"(\*\.)?[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?", re.IGNORECASE)


def _is_host_pattern(value) -> bool:
    if not isinstance(value, str):
        return False
    if value == "*" or _HOST_NAME.fullmatch(value):
        return True
    try:
        ipaddress.ip_address(value[1:-1] if value.startswith("[") and value.endswith("]") else value)
        return True
    except ValueError:
        return False
