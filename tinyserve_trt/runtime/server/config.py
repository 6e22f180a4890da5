"""ServerConfig: what ``tinyserve serve`` adds on top of EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side limits; validated here, the CLI takes its defaults from them.

    host, port:        where uvicorn listens (loopback by default).
    model_name:        the id clients pass as ``model``; None = the package directory's name.
    max_queue:         requests allowed to wait beyond the engine's ``max_batch`` running ones;
                       the server holds at most ``max_batch + max_queue`` requests and answers
                       429 to the next (a request with ``n`` samples or a list of prompts counts once).
    timeout:           seconds a request may take from arrival to its last token; past it the
                       request is aborted (its pages freed) and answered 504. None = no limit.
    graceful_shutdown: seconds uvicorn waits for open requests on shutdown.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    max_queue: int = 256
    timeout: float | None = 600.0
    graceful_shutdown: float = 5.0

    def __post_init__(self):
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        if not _is_int(self.port) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {self.port!r}")
        if self.model_name is not None and (not isinstance(self.model_name, str) or not self.model_name):
            raise ValueError(f"model_name must be a non-empty string or None, got {self.model_name!r}")
        if not _is_int(self.max_queue) or self.max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {self.max_queue!r}")
        if self.timeout is not None and (not isinstance(self.timeout, (int, float)) or isinstance(self.timeout, bool)
                                         or not self.timeout > 0):
            raise ValueError(f"timeout must be seconds > 0 or None, got {self.timeout!r}")
        if not isinstance(self.graceful_shutdown, (int, float)) or self.graceful_shutdown < 0:
            raise ValueError(f"graceful_shutdown must be seconds >= 0, got {self.graceful_shutdown!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
