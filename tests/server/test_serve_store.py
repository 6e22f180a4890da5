"""Two ``tinyserve serve`` processes on one --kv-cache-dir (issue #33: replicas share the store,
without Ray): the one started second answers a prompt the first already served from the shared
store - its /metrics say the prefix came from disk - with the text a recomputation gives."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import MODEL

ROOT = Path(__file__).resolve().parents[2]
PROMPT = ("A shared system prompt that both replicas see: answer in one short sentence, name the tool, "
          "say what it is for, and never use more than twelve words. Question: what is a hammer for?")
GREEDY = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})


def _serve(pkg, cache_dir):
    """A ``serve`` process over ``pkg`` storing pages in ``cache_dir`` as it computes them; (proc, url)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "tinyserve_trt.runtime.cli", "serve", str(pkg), "--port", str(port),
           "--served-model-name", MODEL, "--max-batch", "1", "--threads", "1", "--log-level", "warning",
           "--kv-cache-dir", str(cache_dir), "--kv-cache-write-through"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"tinyserve serve did not come up: {proc.communicate()[0]}")
        time.sleep(0.2)


def _metrics(url):
    from tinyserve_trt.runtime.server.metrics import parse_metrics

    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text)


def _complete(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    return client.completions.create(prompt=PROMPT, **GREEDY)


def _published(cache_dir, want: int, timeout: float = 30.0) -> int:
    """Entries under ``cache_dir`` once ``want`` are there (the first server's writer thread
    publishes them just after its step), or as many as there are at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        n = len(list(Path(cache_dir).rglob("*.kvp")))
        if n >= want or time.monotonic() > deadline:
            return n
        time.sleep(0.1)


def test_a_serve_process_started_second_answers_from_the_shared_store(llama, tmp_path):
    _, pkg, manifest = llama
    procs = []
    try:
        first, url_a = _serve(pkg, tmp_path)
        procs.append(first)
        a = _complete(url_a)
        full_pages = a.usage.prompt_tokens // manifest["page_size"]
        assert full_pages >= 4  # a prefix worth storing
        assert _published(tmp_path, full_pages) >= full_pages
        m_a = _metrics(url_a)
        assert m_a.get('tinyserve_ttft_by_prefix_source_seconds_count{source="none"}') == 1  # computed
        second, url_b = _serve(pkg, tmp_path)  # started after, the first still serving
        procs.append(second)
        b = _complete(url_b)
        assert b.choices[0].text == a.choices[0].text and b.usage == a.usage
        m_b = _metrics(url_b)
        assert m_b.get('tinyserve_ttft_by_prefix_source_seconds_count{source="disk"}') == 1
        assert 'tinyserve_ttft_by_prefix_source_seconds_count{source="none"}' not in m_b
        assert m_b['tinyserve_prefix_pages_reused_total{tier="disk"}'] >= full_pages - 1  # all but the last
        assert m_b['tinyserve_kv_store_bytes_total{tier="disk",direction="read"}'] > 0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
