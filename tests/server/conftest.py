"""A real tinyserve server (uvicorn on a free 127.0.0.1 port, in a background thread) over the
tiny LLaMA package, shared by the server tests; and helpers to read its /metrics."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MODEL = "tiny"
FUZZ_REPORT: list[str] = []  # lines the fuzz test leaves for the terminal summary (CI's log)


def pytest_terminal_summary(terminalreporter):
    for line in FUZZ_REPORT:
        terminalreporter.write_line(line)


class LiveServer:
    """uvicorn serving ``create_app(llm, config)`` on 127.0.0.1 until ``stop()``."""

    def __init__(self, llm, config, **app_options):
        import uvicorn

        from tinyserve_trt.runtime.server import create_app

        self.llm = llm
        self.app = create_app(llm, config, **app_options)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self.sock]), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        from tinyserve_trt.runtime.server.metrics import parse_metrics

        r = httpx.get(self.url + "/metrics", timeout=30)
        r.raise_for_status()
        return parse_metrics(r.text)

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """/metrics once no request is in flight and no page is held by a live sequence."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["tinyserve_requests_in_flight"] == 0 and m['tinyserve_kv_pages{state="used"}'] == 0:
                return m
            if time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def check_integrity(self) -> dict:
        """Scheduler + pool + prefix cache invariants, checked on the engine thread; engine stats."""
        def check(engine):
            engine.scheduler.check_integrity()
            return engine.stats()

        return asyncio.run(self.llm.run_on_engine(check))

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


def requests_total(m: dict, status: str, endpoint: str | None = None) -> float:
    return sum(v for k, v in m.items() if k.startswith("tinyserve_requests_total{")
               and f'status="{status}"' in k and (endpoint is None or f'endpoint="{endpoint}"' in k))


@pytest.fixture(scope="session")
def server(llama):
    from tinyserve_trt import AsyncLLM
    from tinyserve_trt.runtime.server import ServerConfig

    llm = AsyncLLM(llama[1], max_batch=64)
    live = LiveServer(llm, ServerConfig(model_name=MODEL, timeout=60))
    yield live
    live.stop()  # the app's shutdown stops the engine thread


@pytest.fixture(scope="session")
def client(server):
    return server.client(timeout=60)


def package_with_template(source, root, name: str, template: str):
    """A copy of the package at ``source`` under ``root/name`` whose chat template is ``template``
    (``chat_template.jinja`` wins over tokenizer_config.json's): the template is package input."""
    import shutil
    from pathlib import Path

    dest = Path(root) / name
    shutil.copytree(source, dest)
    (dest / "chat_template.jinja").write_text(template)
    return dest


class HealthProbe:
    """Polls ``/health`` from a thread every ``interval`` s until ``stop()``; ``latencies``
    holds each answer's seconds (a probe that failed or timed out counts as ``inf``)."""

    def __init__(self, url: str, interval: float = 0.05, timeout: float = 2.0):
        self.url, self.interval, self.timeout = url, interval, timeout
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        with httpx.Client(timeout=self.timeout) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    ok = c.get(self.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.perf_counter() - t0 if ok else float("inf"))
                self._stop.wait(self.interval)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join(timeout=self.timeout + 5)
        return self.latencies


def post_while_probing(url: str, path: str, body: dict, timeout: float):
    """(response, seconds the POST took, /health latencies meanwhile): one POST of ``body`` to
    ``url + path`` with a ``HealthProbe`` running around it."""
    probe = HealthProbe(url)
    time.sleep(0.2)
    t0 = time.monotonic()
    try:
        r = httpx.post(url + path, json=body, timeout=timeout)
    finally:
        elapsed = time.monotonic() - t0
        latencies = probe.stop()
    return r, elapsed, latencies
