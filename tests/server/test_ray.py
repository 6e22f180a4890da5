"""``serve --replicas 2`` on a local Ray cluster (2 CPUs, 2 tiny replicas), driven by the openai
client: streaming and errors as on one server, API key, warm-up on the owners, requests
sharing a prefix land on one replica (its rendezvous owner), and a replica killed
mid-stream ends its streams with an error (no hung client) while the fleet recovers."""

from __future__ import annotations

import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

pytest.importorskip("ray", reason="Ray tests need the scale extra: pip install 'tinyserve-trt[scale]'")
pytest.importorskip("ray.serve", reason="Ray tests need ray[serve] (the scale extra)")

from tests.server.conftest import MODEL  # noqa: E402

KEY = "sk-ray-test"
SYSTEMS = [f"You are assistant number {i}; answer in one short sentence about tools. " for i in range(4)]
WARM = {"messages": [{"role": "system", "content": "Warm prompt: list three kinds of screws and nails."}]}
LONG = dict(model=MODEL, max_tokens=400, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def fleet(llama):
    from tinyserve_trt.runtime.server import ServerConfig
    from tinyserve_trt.runtime.server.ray_app import ScaleConfig, deploy, shutdown

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ServerConfig(port=port, model_name=MODEL, timeout=120, api_key=KEY, max_queue=16)
    scale = ScaleConfig(replicas=2, replica_cpus=1.0, route_pages=4)
    handle = deploy(str(llama[1]), config, scale, dict(max_batch=8, threads=1), warmup=[WARM], num_cpus=2)
    url = f"http://127.0.0.1:{port}"
    yield handle, url
    shutdown()


def _client(url, key=KEY):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def _stats(handle) -> dict[str, dict]:
    return handle.stats.remote().result(timeout_s=60)


def test_api_through_the_fleet(fleet):
    handle, url = fleet
    client = _client(url)
    assert [m.id for m in client.models.list()] == [MODEL]
    out = client.completions.create(model=MODEL, prompt="hello there", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens >= 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(text, str)
    with pytest.raises(openai.BadRequestError) as e:  # the replica's validation, unchanged
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="other", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        _client(url, "sk-wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # no key needed
    assert httpx.get(url + "/metrics", timeout=30).status_code == 401
    from tinyserve_trt.runtime.server.metrics import parse_metrics

    m = parse_metrics(httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).text)
    assert m["tinyserve_replicas"] == 2
    per_replica = [k for k in m if k.startswith('tinyserve_kv_pages_total{replica=')]
    assert len(per_replica) == 2 and m["tinyserve_kv_pages_total"] == sum(m[k] for k in per_replica)
    assert "tinyserve_queue_depth" in m and "tinyserve_prefix_cache_hit_rate" in m


def test_warmup_ran_on_the_owner_and_its_first_request_hits(fleet):
    handle, url = fleet
    before = {rid: s["prefix_tokens_reused"] for rid, s in _stats(handle).items()}
    raw = _client(url).chat.completions.with_raw_response.create(model=MODEL, messages=WARM["messages"],
                                                                  max_tokens=2)
    rid = raw.headers["x-tinyserve-replica"]
    after = _stats(handle)
    assert after[rid]["prefix_tokens_reused"] - before[rid] >= 8  # the warmed pages were reused


def test_requests_sharing_a_prefix_land_on_its_owner(fleet, llama):
    from tinyserve_trt.runtime.model_package import ModelPackage
    from tinyserve_trt.runtime.server.router import rendezvous_order, route_key
    from tinyserve_trt.runtime.server.warmup import prompt_token_ids

    handle, url = fleet
    package = ModelPackage.load(llama[1])
    ids = sorted(_stats(handle))
    client = _client(url)
    seen = {}
    for system in SYSTEMS:
        for q in ("Where are the hammers?", "Do you sell glue?", "What time do you close?"):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=2)
            seen.setdefault(system, set()).add(raw.headers["x-tinyserve-replica"])
            key = route_key(prompt_token_ids(package, messages=messages), package.page_size, 4)
            assert raw.headers["x-tinyserve-replica"] == rendezvous_order(key, ids)[0]
    assert all(len(replicas) == 1 for replicas in seen.values()), seen


def test_killed_replica_ends_its_streams_and_the_fleet_recovers(fleet):
    handle, url = fleet
    client = _client(url)
    pids = {rid: s["pid"] for rid, s in _stats(handle).items()}
    prompts = [s + "Tell me everything." for s in SYSTEMS]

    streams = []
    for p in prompts:  # opened (headers received, first token out) before the kill
        raw = client.completions.with_raw_response.create(prompt=p, stream=True, **LONG)
        stream = raw.parse()
        next(iter(stream))
        streams.append((raw.headers["x-tinyserve-replica"], stream))

    def consume(stream):
        try:
            for _ in stream:
                pass
            return "done"
        except openai.APIError as e:
            return "error" if "replica" in str(e) else f"other error: {e}"

    victim = streams[0][0]
    with ThreadPoolExecutor(len(streams)) as pool:
        futures = [pool.submit(consume, s) for _, s in streams]
        os.kill(pids[victim], signal.SIGKILL)
        results = [f.result(timeout=120) for f in futures]  # nobody hangs
    for (rid, _), result in zip(streams, results):
        assert result == ("error" if rid == victim else "done"), (rid, victim, results)
    deadline = time.monotonic() + 90  # new requests are served (by the live replica, then both)
    while True:
        try:
            out = client.completions.create(model=MODEL, prompt="after the crash", max_tokens=2)
            assert out.usage.completion_tokens >= 1
            break
        except openai.APIError:
            assert time.monotonic() < deadline, "the fleet did not recover"
            time.sleep(1)
    while True:  # Ray Serve replaced the dead replica
        try:
            stats = _stats(handle)
        except Exception as e:  # a call to the dead replica before the router heard of its death
            stats = {"error": repr(e)}
        if len(stats) == 2 and victim not in stats:
            break
        assert time.monotonic() < deadline, f"no replacement replica: {list(stats)}"
        time.sleep(2)
