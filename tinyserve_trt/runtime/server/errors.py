"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with a status.

Handlers raise ``APIError``; the app turns it (and FastAPI's own validation and
HTTP errors) into that body. Input problems are 4xx, never 500.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

# HTTP status -> OpenAI error "type"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 429: "rate_limit_error", 499: "client_closed_request",
               500: "internal_error", 503: "service_unavailable", 504: "timeout_error"}


# one-word request fields a ValueError message may start with (others contain "_")
_PARAMS = {"temperature", "seed", "stop", "n", "logprobs", "prompt", "messages"}


class APIError(Exception):
    """An error answered to the client; ``status`` picks the HTTP code and the error type."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(e: ValueError) -> APIError:
    """A 400 for a ValueError raised by SamplingParams / the scheduler; ``param`` is the
    field the message starts with (``"max_tokens must be ..."`` -> ``max_tokens``)."""
    msg = " ".join(str(e).split())
    first = msg.split(" ", 1)[0]
    param = first if (first.isidentifier() and "_" in first) or first in _PARAMS else None
    return bad_request(msg, param=param)

