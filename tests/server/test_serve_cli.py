"""``tinyserve serve`` as a subprocess with tight limits: 429 when the queue is full, 504 when a
request outlives --timeout (its pages freed), clean exit on SIGINT."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, requests_total

ROOT = Path(__file__).resolve().parents[2]
LONG = dict(model=MODEL, max_tokens=8000, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def cli_server(llama):
    with socket.socket() as s:  # a free port; released just before the server binds it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "tinyserve_trt.runtime.cli", "serve", str(llama[1]), "--port", str(port),
           "--served-model-name", MODEL, "--max-batch", "1", "--max-queue", "1", "--timeout", "2",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"tinyserve serve did not come up: {proc.communicate()[0]}")
        time.sleep(0.2)
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _metrics(url):
    from tinyserve_trt.runtime.server.metrics import parse_metrics

    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text)


def test_full_queue_answers_429(cli_server):
    _, url = cli_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    held = [client.completions.create(prompt=f"hold {i}", stream=True, **LONG) for i in range(2)]  # 1 runs, 1 waits
    next(iter(held[0]))
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(prompt="one too many", **LONG)
    assert e.value.body["code"] == "queue_full" and e.value.body["type"] == "rate_limit_error"
    for s in held:
        s.close()


def test_timeout_answers_504_and_frees_pages(cli_server):
    _, url = cli_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    for _ in range(100):  # the streams of the previous test are aborted
        if _metrics(url)["tinyserve_requests_in_flight"] == 0:
            break
        time.sleep(0.1)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(prompt="too long", **LONG)
    assert e.value.status_code == 504 and e.value.body["code"] == "timeout"
    assert 1.5 < time.monotonic() - t0 < 10
    with pytest.raises(openai.APIError, match="timeout"):  # a stream ends with an error event
        for _ in client.completions.create(prompt="too long", stream=True, **LONG):
            pass
    m = _metrics(url)
    assert requests_total(m, "504") == 2
    assert m['tinyserve_kv_pages{state="used"}'] == 0 and m["tinyserve_requests_in_flight"] == 0


def test_metrics_say_which_kernel_runs(cli_server):
    _, url = cli_server
    m = _metrics(url)
    (info,) = [k for k in m if k.startswith("tinyserve_kernel_info{")]
    assert m[info] == 1 and 'provider="cpu"' in info and "decode=" in info and "graph=" in info
    assert m["tinyserve_kernel_fallback"] in (0, 1)


def test_sigint_exits_cleanly(cli_server):
    proc, _ = cli_server
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
