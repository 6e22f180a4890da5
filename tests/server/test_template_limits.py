"""The chat template is package input (issue #29): it renders, and prompts tokenize, in a
worker process with a deadline and a memory limit, never on the event loop. A template
that loops forever, or allocates gigabytes, costs one 400 and never /health's answer."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MODEL, LiveServer, package_with_template, post_while_probing

ROOT = Path(__file__).resolve().parents[2]
NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
WIDE = "{{ 'x' * 10**7 }}"  # ten million characters: a prompt no context holds
HUGE = "{{ 'x' * 10**10 }}"  # ten gigabytes (built while the template compiles)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def bad_template_server(llama, tmp_path_factory):
    """Servers over copies of the tiny package with ``template``; the render worker warmed
    by a text completion (that starts it), so a request's time is its own."""
    from tinyserve_trt import AsyncLLM
    from tinyserve_trt.runtime.server import ServerConfig

    root = tmp_path_factory.mktemp("templates")
    live = {}

    def get(name: str, template: str) -> LiveServer:
        if name not in live:
            pkg = package_with_template(llama[1], root, name, template)
            live[name] = LiveServer(AsyncLLM(pkg, max_batch=4), ServerConfig(model_name=MODEL, timeout=60))
            r = httpx.post(live[name].url + "/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": "warm", "max_tokens": 1})
            assert r.status_code == 200, r.text
        return live[name]

    yield get
    for server in live.values():
        server.stop()


def _chat_while_probing(server):
    return post_while_probing(server.url, "/v1/chat/completions", CHAT, timeout=10)


def _one_line_400(r):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "messages"
    assert "\n" not in err["message"] and len(err["message"]) < 300
    return err


def test_a_nested_loop_template_is_400_in_bounded_time_and_health_stays_fast(bad_template_server):
    server = bad_template_server("nested", NESTED)
    r, elapsed, latencies = _chat_while_probing(server)
    err = _one_line_400(r)
    assert err["code"] == "render_timeout", err
    assert elapsed <= 5.0
    assert len(latencies) >= 10 and max(latencies) < 0.1, sorted(latencies)[-5:]
    # the worker that ran it was killed and replaced: the server goes on answering text prompts
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "again", "max_tokens": 1},
                   timeout=30)
    assert r.status_code == 200, r.text


def test_an_oversized_template_output_is_400_without_tokenizing_it(bad_template_server):
    server = bad_template_server("wide", WIDE)
    r, elapsed, latencies = _chat_while_probing(server)
    err = _one_line_400(r)
    assert err["code"] == "context_length_exceeded", err
    assert elapsed <= 5.0 and max(latencies) < 0.1, sorted(latencies)[-5:]


def test_a_template_that_allocates_gigabytes_is_400(bad_template_server):
    server = bad_template_server("huge", HUGE)
    r, elapsed, latencies = _chat_while_probing(server)
    err = _one_line_400(r)
    assert err["code"] in ("render_memory", "render_timeout"), err
    assert elapsed <= 5.0 and max(latencies) < 0.1, sorted(latencies)[-5:]
    assert httpx.get(server.url + "/health").status_code == 200


def test_jinja2_pin_has_the_sandbox_fixes():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [d for d in project["optional-dependencies"]["serve"] if d.lower().startswith("jinja2")]
    assert pins == ["jinja2>=3.1.6"], pins  # 3.1.5 / 3.1.6 fixed sandbox escapes (format, |attr)
