"""Admission: the bounded number of sequences the server holds at once (429 beyond it)."""

from __future__ import annotations

from tinyserve_trt.runtime.server.errors import APIError


class Admission:
    """Counts requests, and the sequences they decode (prompts x ``n``), from acceptance to
    their last byte. Event-loop thread only.

    ``limit`` = engine ``max_batch`` (running sequences) + ``max_queue`` (waiting ones), in
    sequences: a request of 64 prompts x n=16 weighs 1024, not 1, so the engine's waiting
    queue holds at most about ``max_queue`` sequences whatever the requests look like.
    """

    def __init__(self, limit: int):
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        self.limit = limit
        self.in_flight = 0  # requests
        self.sequences = 0

    def acquire(self, sequences: int = 1) -> None:
        """Take ``sequences`` slots, or raise APIError: 400 when the request could never fit,
        429 when the server is full now. Pair with exactly one ``release(sequences)``."""
        if not isinstance(sequences, int) or sequences < 1:
            raise ValueError(f"sequences must be an int >= 1, got {sequences!r}")
        if sequences > self.limit:
            raise APIError(400, f"this request decodes {sequences} sequences (prompts x n); this server holds at "
                                f"most {self.limit} at once", param="n", code="too_many_sequences")
        if self.sequences + sequences > self.limit:
            raise APIError(429, f"the server is at capacity ({self.sequences} of {self.limit} sequences in "
                                f"flight); retry later", code="queue_full")
        self.in_flight += 1
        self.sequences += sequences

    def release(self, sequences: int = 1) -> None:
        if self.in_flight <= 0 or sequences > self.sequences:
            raise RuntimeError("Admission.release without acquire")
        self.in_flight -= 1
        self.sequences -= sequences
