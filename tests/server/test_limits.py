"""No request can take the server down (issue #19): every field is bounded at the boundary,
and a request past a bound is a 400 in OpenAI's shape before anything is queued."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL, requests_total

CHAT = [{"role": "user", "content": "hi"}]


def _post(server, path, **kw):
    return httpx.post(server.url + path, timeout=60, **kw)


@pytest.mark.parametrize("body, param, code", [
    # the outage: an int32 overflow inside the engine thread killed it
    ({"prompt": "hi", "max_tokens": 2, "token_budget": 10**12}, "token_budget", None),
    ({"prompt": "hi", "max_tokens": 2, "token_budget": 100000}, "token_budget", None),  # past the context
    ({"prompt": "hi", "max_tokens": 2, "n": 1000}, "n", None),
    ({"prompt": "hi", "max_tokens": 2, "n": 100000}, "n", None),
    ({"prompt": "hi", "max_tokens": 2, "n": 17}, "n", None),  # ServerConfig.max_n (16)
    ({"prompt": "hi", "max_tokens": 2, "best_of": 1000, "n": 1000}, "n", None),
    ({"prompt": "hi", "max_tokens": 2, "seed": 2**64}, "seed", None),
    ({"prompt": "hi", "max_tokens": 2**31}, "max_tokens", None),
    ({"prompt": "hi", "max_tokens": 2, "top_k": 2**40}, "top_k", None),
    ({"prompt": "hi", "max_tokens": 2, "stop_token_ids": [256]}, "stop_token_ids", None),
    ({"prompt": "hi", "max_tokens": 2, "stop_token_ids": [2**31]}, "stop_token_ids", None),
    ({"prompt": "hi", "max_tokens": 2, "stop": ["x"] * 17}, "stop", None),
    ({"prompt": [[1, 2]] * 65, "max_tokens": 2}, "prompt", None),  # ServerConfig.max_prompts (64)
    ({"prompt": [2**40], "max_tokens": 2}, "prompt", None),
])
def test_out_of_bounds_fields_are_400(server, body, param, code):
    r = _post(server, "/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


@pytest.mark.parametrize("raw, param", [
    (b'"temperature": Infinity', "temperature"),
    (b'"temperature": NaN', "temperature"),
    (b'"top_p": -Infinity', "top_p"),
    (b'"repetition_penalty": 1e999', "repetition_penalty"),  # JSON's overflow to inf
    (b'"presence_penalty": NaN', "presence_penalty"),
])
def test_non_finite_floats_are_400(server, raw, param):
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "max_tokens": 2, ' + raw + b"}"
    r = _post(server, "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("depth", [33, 5000])  # 5000 was a 500 (RecursionError)
def test_deeply_nested_bodies_are_400(server, depth):
    body = '{"a":' * depth + "1" + "}" * depth
    r = _post(server, "/v1/chat/completions", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "body_too_deep"


def test_nesting_within_the_limit_is_validated_normally(server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]  # 4 levels deep
    body = {"model": MODEL, "messages": parts, "max_tokens": 2}
    r = _post(server, "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


def test_oversized_bodies_are_400_unread(server):
    big = {"model": MODEL, "prompt": "x" * (8 << 20), "max_tokens": 1}
    r = _post(server, "/v1/completions", json=big)
    assert r.status_code == 400 and r.json()["error"]["code"] == "body_too_large"

    def chunks():  # no Content-Length: the reader counts as it goes
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(9):
            yield b"x" * (1 << 20)
        yield b'"}'

    r = _post(server, "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "body_too_large"


def test_bounded_requests_leave_the_server_serving(server, client):
    """After all of the above: nothing queued, no page held, no 5xx, /health 200, and a
    normal request still answers (a request was an outage before)."""
    bad = [{"prompt": "hi", "max_tokens": 2, "token_budget": 10**12}, {"prompt": "hi", "n": 100000}]
    for body in bad:
        assert _post(server, "/v1/completions", json={"model": MODEL, **body}).status_code == 400
    assert httpx.get(server.url + "/health").status_code == 200
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    m = server.wait_idle()
    assert requests_total(m, "500") == 0 and requests_total(m, "503") == 0
    assert server.check_integrity()["pages_in_use"] == 0


def test_sampling_defaults_come_from_the_package(server, client):
    """No temperature in the request: the package's default (greedy: the tiny package has no
    generation config), so two identical requests agree; an explicit temperature overrides."""
    kw = dict(model=MODEL, prompt="abc", max_tokens=6, extra_body={"ignore_eos": True})
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    assert a == b == greedy
