"""Reading a request's JSON body within the server's limits (media type, size, time, nesting).

A POST body must be declared ``application/json`` (optionally ``; charset=utf-8``),
else 415 before it is read: the cross-origin POSTs a web page may send without a CORS
preflight are ``text/plain`` or forms, so this keeps pages from driving the server.
The body is read in chunks and refused once it passes ``max_bytes`` (a client's
``Content-Length`` is checked first, so an announced oversize body is not read at
all), or answered 408 when it has not arrived in full within ``timeout_s`` (a client
that sends slowly, or stops, holds no connection forever). JSON deeper than the decoder's recursion limit, or than ``max_depth``,
is refused before validation: no request reaches a RecursionError.
"""

from __future__ import annotations

import asyncio
import json

from starlette.requests import Request

from tinyserve_trt.runtime.server.errors import APIError, bad_request


def is_json_media_type(value: str | None) -> bool:
    """``application/json`` with no parameter but ``charset=utf-8`` (any case); False for None."""
    if value is None:
        return False
    media, *params = (part.strip().lower() for part in value.split(";"))
    if media != "application/json":
        return False
    for param in params:
        name, _, charset = param.partition("=")
        if name.strip() == "charset" and charset.strip().strip('"') not in ("utf-8", "utf8"):
            return False
    return True


def unsupported_media_type() -> APIError:
    return APIError(415, "the request body must be JSON sent with 'Content-Type: application/json'",
                    code="unsupported_media_type")


def json_depth(value, limit: int) -> int:
    """Nesting depth of arrays/objects in ``value`` (a scalar is 0), counted without
    recursion; stops counting once it passes ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def body_timeout(timeout_s: float) -> APIError:
    return APIError(408, f"the request body did not arrive within the server's {timeout_s:g} s limit",
                    code="body_timeout")


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The raw body; APIError(400) past ``max_bytes``, APIError(408) past ``timeout_s``."""
    announced = request.headers.get("content-length")
    if announced is not None and announced.isdigit() and int(announced) > max_bytes:
        raise bad_request(f"the request body is larger than the server's limit of {max_bytes} bytes",
                          code="body_too_large")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise bad_request(f"the request body is larger than the server's limit of {max_bytes} bytes",
                                  code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise body_timeout(timeout_s) from None


async def read_json(request: Request, max_bytes: int, max_depth: int, timeout_s: float):
    """The parsed body; APIError(415) if it is not declared JSON, APIError(400) if it is too
    large, not JSON, or nested too deeply, APIError(408) if it is too slow to arrive."""
    if not is_json_media_type(request.headers.get("content-type")):
        raise unsupported_media_type()
    raw = await read_body(request, max_bytes, timeout_s)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON ({e})") from None
    except RecursionError:  # the decoder recursed past Python's limit: far deeper than max_depth
        body = None
        depth = "more than the decoder's recursion limit"
    else:
        found = json_depth(body, max_depth)
        depth = None if found <= max_depth else f"more than {max_depth}"
    if depth is not None:
        raise bad_request(f"the request body nests arrays/objects {depth} levels deep; the limit is {max_depth}",
                          code="body_too_deep")
    return body
