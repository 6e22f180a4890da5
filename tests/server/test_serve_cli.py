"""``tinyserve serve`` as a subprocess with tight limits: 429 when the queue is full, 504 when a
request outlives --timeout (its pages freed), clean exit on SIGINT."""

from __future__ import annotations

import signal
import time

import openai
import pytest

from tests.server.conftest import MODEL, requests_total
from tinyserve_dev.serve_process import metrics, start_serve

LONG = dict(model=MODEL, max_tokens=8000, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def cli_server(llama):
    proc, url = start_serve(llama[1], "--served-model-name", MODEL, "--max-batch", "1", "--max-queue", "1",
                            "--timeout", "2", "--log-level", "warning")
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


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
        if metrics(url)["tinyserve_requests_in_flight"] == 0:
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
    m = metrics(url)
    assert requests_total(m, "504") == 2
    assert m['tinyserve_kv_pages{state="used"}'] == 0 and m["tinyserve_requests_in_flight"] == 0


def test_metrics_say_which_kernel_runs(cli_server):
    _, url = cli_server
    m = metrics(url)
    (info,) = [k for k in m if k.startswith("tinyserve_kernel_info{")]
    assert m[info] == 1 and 'provider="cpu"' in info and "decode=" in info and "graph=" in info
    assert m["tinyserve_kernel_fallback"] in (0, 1)


def test_sigint_exits_cleanly(cli_server):
    proc, _ = cli_server
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
