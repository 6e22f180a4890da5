"""Bad requests get 4xx with OpenAI's error shape, never 500, and leave nothing behind."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, requests_total

CHAT = [{"role": "user", "content": "hi"}]


def _shape(body: dict) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": "x"}, 400, "model"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 400, "model"),  # bad input: 400, as the issue asks
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 999]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10 ** 6}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": list(range(3, 250)) * 40}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "frequency_penalty": 1}, 400, "frequency_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True}, 400, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "bogus": 1}, 400, "bogus"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "token_budget": -2}, 400, "token_budget"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
])
def test_bad_request_shape(server, path, body, status, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(server.url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = _shape(r.json())
    assert err["param"] == param and err["type"] == ("not_found_error" if status == 404 else
                                                     "invalid_request_error")


def test_wrong_route_and_method_keep_the_shape(server):
    assert _shape(httpx.get(server.url + "/v1/nothing").json())["type"] == "not_found_error"
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and _shape(r.json())


def test_openai_client_raises_typed_errors_and_nothing_leaks(server, client):
    before = server.metrics()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=100000)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    with pytest.raises(openai.BadRequestError):  # rejected before the stream starts
        client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, temperature=-3)
    m = server.wait_idle()
    assert requests_total(m, "400") - requests_total(before, "400") == 3
    assert requests_total(m, "500") == 0 and m["tinyserve_requests_in_flight"] == 0
    assert server.check_integrity()["pages_in_use"] == 0
