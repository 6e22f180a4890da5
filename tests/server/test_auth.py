"""--api-key: without ``Authorization: Bearer KEY`` (or with a wrong one) every route but /health
answers 401 in OpenAI's error shape and nothing reaches the engine; the right key works through
the openai client."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, LiveServer, requests_total

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def keyed(llama):
    from tinyserve_trt import AsyncLLM
    from tinyserve_trt.runtime.server import ServerConfig

    live = LiveServer(AsyncLLM(llama[1], max_batch=4), ServerConfig(model_name=MODEL, timeout=60, api_key=KEY))
    yield live
    live.stop()


def _metrics(live) -> dict:
    from tinyserve_trt.runtime.server.metrics import parse_metrics

    r = httpx.get(live.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    r.raise_for_status()
    return parse_metrics(r.text)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                                     {"Authorization": f"Bearer {KEY}x"}, {"Authorization": "Bearer"}])
def test_missing_or_wrong_key_is_401_and_nothing_runs(keyed, headers):
    before = _metrics(keyed)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    for method, path, kw in [("POST", "/v1/completions", {"json": body}),
                             ("POST", "/v1/chat/completions", {"json": {"model": MODEL, "messages": []}}),
                             ("GET", "/v1/models", {}), ("GET", "/metrics", {}), ("GET", "/no/such/route", {}),
                             ("GET", "/openapi.json", {})]:
        r = httpx.request(method, keyed.url + path, headers=headers, timeout=30, **kw)
        assert r.status_code == 401, (path, r.text)
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key" and err["param"] is None
        assert KEY not in r.text
    after = _metrics(keyed)
    for name in ("tinyserve_prompt_tokens_total", "tinyserve_generation_tokens_total"):
        assert after.get(name, 0) == before.get(name, 0)  # the engine saw nothing
    assert requests_total(after, "200") == requests_total(before, "200")
    assert sum(v for k, v in after.items() if k.startswith("tinyserve_requests_total")) == \
        sum(v for k, v in before.items() if k.startswith("tinyserve_requests_total"))  # never reached a handler


def test_health_needs_no_key(keyed):
    assert httpx.get(keyed.url + "/health", timeout=30).status_code == 200


def test_openai_client_with_the_key_works_and_without_raises(keyed):
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    out = good.completions.create(model=MODEL, prompt="hello there", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1
    chunks = list(good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason is not None
    assert [m.id for m in good.models.list()] == [MODEL]
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):  # a stream is refused before it starts
        bad.completions.create(model=MODEL, prompt="hello", max_tokens=3, stream=True)


def test_key_is_validated_and_kept_out_of_repr():
    from tinyserve_trt.runtime.server import ServerConfig

    assert KEY not in repr(ServerConfig(api_key=KEY))
    for bad in ("", " padded", "tab\tkey", "kéy", 123):
        with pytest.raises(ValueError, match="api_key"):
            ServerConfig(api_key=bad)


def test_constant_time_compare_and_bind_warning():
    from tinyserve_trt.runtime.server.auth import bearer_token, bind_warning, key_matches

    assert bearer_token([(b"authorization", b"Bearer  abc ")]) == b"abc"
    assert bearer_token([(b"Authorization", b"bearer abc")]) == b"abc"
    assert bearer_token([(b"authorization", b"Token abc")]) is None and bearer_token([]) is None
    assert key_matches(b"abc", "abc") and not key_matches(b"abd", "abc") and not key_matches(None, "abc")
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert bind_warning(host, None) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "myhost.example"):
        assert "without an API key" in bind_warning(host, None)
        assert bind_warning(host, KEY) is None


def test_cli_bad_key_is_one_line_exit_2(capsys):
    from tinyserve_trt.runtime.cli import main

    assert main(["serve", "/nonexistent", "--api-key", " spaced "]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "api_key" in err


def test_cli_warns_on_open_non_loopback_bind_and_reads_env_key(monkeypatch, capsys, tmp_path):
    from tinyserve_trt.runtime.cli import main

    missing = str(tmp_path / "missing")
    assert main(["serve", missing, "--host", "0.0.0.0"]) == 2  # warns, then fails to load the package
    assert "without an API key" in capsys.readouterr().err
    monkeypatch.setenv("TINYSERVE_API_KEY", KEY)
    assert main(["serve", missing, "--host", "0.0.0.0"]) == 2
    assert "without an API key" not in capsys.readouterr().err
    monkeypatch.setenv("TINYSERVE_API_KEY", "bad key\n")
    assert main(["serve", missing]) == 2
    assert "api_key" in capsys.readouterr().err
