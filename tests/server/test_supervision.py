"""A supervised engine (issue #19): a step that raises fails only the requests of its batch,
the server goes on serving (no page leaks, /health 200, the failure in /metrics); an engine
that cannot recover makes /health 503 and the server process exit non-zero."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.runtime.faults import poison_backend
from tests.server.conftest import MODEL, LiveServer, requests_total

ROOT = Path(__file__).resolve().parents[2]
POISON = 99  # a prompt starting with this token makes the backend raise
GENERIC_STEP_FAILURE = "the engine step running this request failed (RuntimeError); the request was aborted"


@pytest.fixture(scope="module")
def one_at_a_time(llama):
    """max_batch=1: each step runs one request, so a failed step is exactly one request."""
    from tinyserve_trt import AsyncLLM
    from tinyserve_trt.runtime.server import ServerConfig

    live = LiveServer(AsyncLLM(llama[1], max_batch=1, dense=True), ServerConfig(model_name=MODEL, timeout=60))
    yield live
    live.stop()


def _complete(url, prompt, stream=False):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_a_failing_step_fails_only_its_request(one_at_a_time, caplog):
    server = one_at_a_time
    caplog.set_level("ERROR", logger="tinyserve.server")
    raised = asyncio.run(server.llm.run_on_engine(lambda e: poison_backend(e, POISON, times=2)))
    prompts = [[5, 6, 7], [8, 9, 10, 11], [POISON, 1, 2], [12, 13], [14, 15, 16]]
    with concurrent.futures.ThreadPoolExecutor(len(prompts) + 1) as pool:  # all in flight together
        answers = list(pool.map(lambda p: _complete(server.url, p), prompts))
        streamed = pool.submit(_complete, server.url, [POISON, 3], True).result()
    for prompt, r in zip(prompts, answers):
        if prompt[0] == POISON:
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_step_failed", r.text
            # the client gets a generic line (the cause's class at most); the details go to the log
            assert r.json()["error"]["message"] == GENERIC_STEP_FAILURE, r.text
        else:
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
    assert streamed.status_code == 200 and '"code": "engine_step_failed"' in streamed.text  # an error event
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert "injected" not in streamed.text and GENERIC_STEP_FAILURE in streamed.text
    assert "injected backend failure" in caplog.text
    assert len(raised) == 2
    assert httpx.get(server.url + "/health").status_code == 200
    m = server.wait_idle()
    assert m["tinyserve_engine_step_failures_total"] == 2 and requests_total(m, "500") == 2  # one streamed
    assert server.check_integrity()["pages_in_use"] == 0
    assert _complete(server.url, [5, 6, 7]).status_code == 200  # and it goes on serving


def test_an_engine_that_cannot_recover_reports_503_and_asks_to_stop(llama):
    from tinyserve_trt import AsyncLLM
    from tinyserve_trt.runtime.server import ServerConfig

    died = []
    live = LiveServer(AsyncLLM(llama[1], dense=True, max_consecutive_failures=2),
                      ServerConfig(model_name=MODEL, timeout=60), on_engine_death=lambda: died.append(True))
    try:
        asyncio.run(live.llm.run_on_engine(lambda e: poison_backend(e, POISON, times=10)))
        for _ in range(2):
            assert _complete(live.url, [POISON, 1]).status_code in (500, 503)
        deadline = time.monotonic() + 10
        while not died and time.monotonic() < deadline:
            time.sleep(0.05)
        assert died == [True]
        r = httpx.get(live.url + "/health")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["message"] == "the engine thread is not running (EngineBroken)", r.text
        r = _complete(live.url, [5, 6])
        assert r.status_code == 503 and "injected" not in r.text and "consecutive" not in r.text, r.text
    finally:
        live.stop()


def test_serve_exits_non_zero_when_the_engine_dies(llama):
    """``tinyserve serve`` whose engine thread fails: the process exits 3 (a supervisor restarts
    it) instead of answering 503 forever."""
    script = (
        "import sys\n"
        "from tinyserve_trt.runtime.engine import Engine\n"
        "def boom(self):\n"
        "    raise RuntimeError('injected: the engine cannot go on')\n"
        "Engine.has_unfinished = boom\n"
        "from tinyserve_trt.runtime.cli import main\n"
        f"sys.exit(main(['serve', {str(llama[1])!r}, '--port', '0', '--log-level', 'critical']))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
