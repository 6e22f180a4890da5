"""Under load and faults: 64 concurrent streaming clients, then clients that leave mid-stream
or while queued. Zero errors, and afterwards no page is held by a finished request."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.server.conftest import MODEL, requests_total

CLIENTS, REQUESTS, MAX_TOKENS = 64, 256, 8


def test_64_streaming_clients_256_requests(server):
    before = server.metrics()

    async def main():
        client = server.async_client(timeout=60, http_client=None)
        todo = iter(range(REQUESTS))
        results = []

        async def worker(w):
            for i in todo:  # shared iterator: each request taken once
                chat = i % 2 == 0
                kw = dict(model=MODEL, max_tokens=MAX_TOKENS, stream=True, temperature=0.8, seed=i,
                          stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                if chat:
                    stream = await client.chat.completions.create(
                        messages=[{"role": "system", "content": "a shared system prompt for every client"},
                                  {"role": "user", "content": f"question {i}"}], **kw)
                else:
                    stream = await client.completions.create(prompt=f"prompt number {i} " * (1 + i % 5), **kw)
                text, usage = "", None
                async for chunk in stream:
                    if chunk.choices:
                        c = chunk.choices[0]
                        text += (c.delta.content or "") if chat else c.text
                    usage = chunk.usage or usage
                results.append((i, text, usage.completion_tokens))

        try:
            await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(CLIENTS))), timeout=110)
        finally:
            await client.close()
        return results

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    assert elapsed < 120
    assert sorted(i for i, _, _ in results) == list(range(REQUESTS))
    assert all(n == MAX_TOKENS for _, _, n in results)
    m = server.wait_idle()
    assert requests_total(m, "200") - requests_total(before, "200") == REQUESTS
    assert not any(requests_total(m, s) - requests_total(before, s) for s in ("400", "429", "499", "500", "503",
                                                                            "504"))
    assert m['tinyserve_kv_pages{state="used"}'] == 0 and m["tinyserve_requests_in_flight"] == 0
    assert m["tinyserve_queue_depth"] == 0 and m["tinyserve_running_sequences"] == 0
    assert m["tinyserve_prefix_cache_hit_rate"] > 0  # the shared system prompt was reused
    stats = server.check_integrity()
    assert stats["pages_in_use"] == 0 and stats["pages_free"] + stats["pages_cached_idle"] == stats["pages_total"]
    print(f"{REQUESTS} requests, {CLIENTS} clients: {elapsed:.1f} s")


def test_clients_that_leave_mid_stream_or_while_waiting(server, client):
    before = server.metrics()
    long = dict(model=MODEL, max_tokens=4000, temperature=0, ignore_eos=True)
    # streams dropped after a few chunks
    streams = [client.completions.create(model=MODEL, prompt=f"leave {i}", max_tokens=4000, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True}) for i in range(16)]
    for s in streams:
        for _, _ in zip(range(3), s):
            pass
    mid = server.metrics()
    assert mid['tinyserve_kv_pages{state="used"}'] > 0 and mid["tinyserve_requests_in_flight"] >= 16
    for s in streams:
        s.close()
    assert server.wait_idle()['tinyserve_kv_pages{state="used"}'] == 0
    # non-streaming requests whose clients give up before the answer (a read timeout): the
    # server notices the closed connection while the request waits or decodes
    give_up = httpx.Timeout(10.0, read=1.0)
    for i in range(8):
        try:
            httpx.post(server.url + "/v1/completions", json=dict(long, prompt=f"gone {i}"), timeout=give_up)
        except httpx.ReadTimeout:
            pass
    m = server.wait_idle()
    assert m['tinyserve_kv_pages{state="used"}'] == 0 and m["tinyserve_requests_in_flight"] == 0
    assert requests_total(m, "499") - requests_total(before, "499") == 24
    assert requests_total(m, "500") == 0
    assert server.check_integrity()["pages_in_use"] == 0
    # and it keeps serving
    r = client.completions.create(model=MODEL, prompt="still there?", max_tokens=4, **{"temperature": 0})
    assert r.usage.completion_tokens >= 1
