"""Request work stays off the event loop and within bounds (issue #29): an oversized prompt is
refused by its length before it is tokenized, a body that never finishes arriving is 408,
and admission counts sequences (prompts x n), not requests."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import MODEL, LiveServer, post_while_probing


def test_a_megabytes_prompt_is_refused_by_its_length_and_health_stays_fast(server):
    body = {"model": MODEL, "prompt": "x" * (7 << 20), "max_tokens": 1}
    r, elapsed, latencies = post_while_probing(server.url, "/v1/completions", body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert elapsed < 2.0  # reading 7 MiB and counting characters; tokenizing it took ~5 s
    assert max(latencies) < 0.1, sorted(latencies)[-5:]


@pytest.fixture(scope="module")
def small(llama):
    """Admission of 4 + 4 sequences; a body must arrive within 0.5 s."""
    from tinyserve_trt import AsyncLLM
    from tinyserve_trt.runtime.server import ServerConfig

    live = LiveServer(AsyncLLM(llama[1], max_batch=4), ServerConfig(model_name=MODEL, timeout=60, max_queue=4,
                                                                     body_timeout_s=0.5))
    yield live
    live.stop()


def test_a_body_that_never_finishes_is_408(small):
    port = int(small.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\": \"tiny\", ")
        t0 = time.monotonic()
        answer = b""
        while b"body_timeout" not in answer and time.monotonic() - t0 < 5:
            try:
                chunk = s.recv(4096)  # bounded by the socket timeout
            except TimeoutError:
                break
            if not chunk:
                break
            answer += chunk
        elapsed = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"body_timeout" in answer and elapsed < 3.0


def _completion(url, prompts, n, **kw):
    return httpx.post(url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": prompts, "n": n, "max_tokens": 2, **kw})


def _wait_for(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _hold_engine(server, seconds: float) -> threading.Thread:
    """Keep the engine thread busy for ``seconds``: admitted requests wait, nothing finishes."""
    t = threading.Thread(target=lambda: asyncio.run(server.llm.run_on_engine(lambda e: time.sleep(seconds))))
    t.start()
    return t


def test_admission_counts_sequences_and_releases_them(small):
    admission = small.app.state.admission
    # 4 prompts x n=4 = 16 sequences: more than the 8 this server holds, whatever the load
    r = _completion(small.url, [[5, 6]] * 4, 4)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences", r.text
    # 8 sequences fit, and are released when answered
    r = _completion(small.url, [[5, 6]] * 2, 4)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8, r.text
    m = small.wait_idle()
    assert m["tinyserve_requests_in_flight"] == 0 and m["tinyserve_sequences_in_flight"] == 0
    # while one request of 7 sequences waits, a request of 2 is 429 and one of 1 is admitted
    blocker = _hold_engine(small, 2.0)
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(_completion, small.url, [[5, 6, 7]], 7)
        assert _wait_for(lambda: admission.sequences == 7)
        r = _completion(small.url, [[5, 6]], 2)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
        one = pool.submit(_completion, small.url, [[5, 6]], 1)
        assert _wait_for(lambda: admission.sequences == 8)
        assert held.result().status_code == 200 and one.result().status_code == 200
    blocker.join()
    assert small.wait_idle()["tinyserve_sequences_in_flight"] == 0
    # a stream whose client leaves releases its sequences too
    blocker = _hold_engine(small, 1.0)
    body = {"model": MODEL, "prompt": [5, 6, 7], "n": 8, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", small.url + "/v1/completions", json=body):
            assert _wait_for(lambda: admission.sequences == 8)
    blocker.join()
    assert _wait_for(lambda: admission.sequences == 0 and admission.in_flight == 0)
    assert _completion(small.url, [[5, 6]] * 2, 4).status_code == 200


def test_admission_unit_counts():
    from tinyserve_trt.runtime.server.admission import Admission
    from tinyserve_trt.runtime.server.errors import APIError

    a = Admission(8)
    a.acquire(7)
    with pytest.raises(APIError) as e:
        a.acquire(2)
    assert e.value.status == 429
    with pytest.raises(APIError) as e:
        a.acquire(9)
    assert e.value.status == 400 and e.value.code == "too_many_sequences"
    a.acquire(1)
    assert (a.in_flight, a.sequences) == (2, 8)
    a.release(7), a.release(1)
    assert (a.in_flight, a.sequences) == (0, 0)
    with pytest.raises(RuntimeError):
        a.release(1)
