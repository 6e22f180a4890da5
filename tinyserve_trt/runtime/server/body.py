"""Reading a request's JSON body within the server's limits (media type, size, nesting).

A POST body must be declared ``application/json`` (optionally ``; charset=utf-8``),
else 415 before it is read: the cross-origin POSTs a web page may send without a CORS
preflight are ``text/plain`` or forms, so this keeps pages from driving the server.
The body is read in chunks and refused once it passes ``max_bytes`` (a client's
``Content-Length`` is checked first, so an announced oversize body is not read at
all). JSON deeper than the decoder's recursion limit, or than ``max_depth``,
is refused before validation: no request reaches a RecursionError.
"""

from __future__ import annotations

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


async def read_json(request: Request, max_bytes: int, max_depth: int):
    """The parsed body; APIError(415) if it is not declared JSON, APIError(400) if it is too
    large, not JSON, or nested too deeply."""
    if not is_json_media_type(request.headers.get("content-type")):
        raise unsupported_media_type()
    announced = request.headers.get("content-length")
    if announced is not None and announced.isdigit() and int(announced) > max_bytes:
        raise bad_request(f"the request body is larger than the server's limit of {max_bytes} bytes",
                          code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise bad_request(f"the request body is larger than the server's limit of {max_bytes} bytes",
                              code="body_too_large")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
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
