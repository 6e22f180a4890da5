"""Two ``tinyserve serve`` processes on one --kv-cache-dir (issue #33: replicas share the store,
without Ray): the one started second answers a prompt the first already served from the shared
store - its /metrics say the prefix came from disk - with the text a recomputation gives."""

from __future__ import annotations

import time
from pathlib import Path

import openai

from tests.server.conftest import MODEL
from tinyserve_dev.serve_process import metrics, start_serve

PROMPT = ("A shared system prompt that both replicas see: answer in one short sentence, name the tool, "
          "say what it is for, and never use more than twelve words. Question: what is a hammer for?")
GREEDY = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})


def _serve(pkg, cache_dir):
    """A ``serve`` process over ``pkg`` storing pages in ``cache_dir`` as it computes them; (proc, url)."""
    return start_serve(pkg, "--served-model-name", MODEL, "--max-batch", "1", "--threads", "1", "--log-level",
                       "warning", "--kv-cache-dir", str(cache_dir), "--kv-cache-write-through", timeout=90)


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
        m_a = metrics(url_a)
        assert m_a.get('tinyserve_ttft_by_prefix_source_seconds_count{source="none"}') == 1  # computed
        second, url_b = _serve(pkg, tmp_path)  # started after, the first still serving
        procs.append(second)
        b = _complete(url_b)
        assert b.choices[0].text == a.choices[0].text and b.usage == a.usage
        m_b = metrics(url_b)
        assert m_b.get('tinyserve_ttft_by_prefix_source_seconds_count{source="disk"}') == 1
        assert 'tinyserve_ttft_by_prefix_source_seconds_count{source="none"}' not in m_b
        assert m_b['tinyserve_prefix_pages_reused_total{tier="disk"}'] >= full_pages - 1  # all but the last
        assert m_b['tinyserve_kv_store_bytes_total{tier="disk",direction="read"}'] > 0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
