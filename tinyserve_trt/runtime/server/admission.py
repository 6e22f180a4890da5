"""Admission: the bounded number of requests the server holds at once (429 beyond it)."""

from __future__ import annotations

from tinyserve_trt.runtime.server.errors import APIError


class Admission:
    """Counts requests from acceptance to their last byte. Event-loop thread only.

    ``limit`` = engine ``max_batch`` (running) + ``max_queue`` (waiting): the engine's
    waiting queue then holds at most about ``max_queue`` requests.
    """

    def __init__(self, limit: int):
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        self.limit = limit
        self.in_flight = 0

    def acquire(self) -> None:
        """Take a slot or raise APIError(429); pair with exactly one ``release``."""
        if self.in_flight >= self.limit:
            raise APIError(429, f"the server is at capacity ({self.limit} requests in flight); retry later",
                           code="queue_full")
        self.in_flight += 1

    def release(self) -> None:
        if self.in_flight <= 0:
            raise RuntimeError("Admission.release without acquire")
        self.in_flight -= 1
