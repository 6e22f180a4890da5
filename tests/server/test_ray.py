"""``serve --replicas 2`` on a local Ray cluster (2 CPUs, 2 tiny replicas), driven by the openai
client: streaming and errors as on one server, API key, warm-up on the owners, requests
sharing a prefix land on one replica (its rendezvous owner), and a replica killed
mid-stream ends its streams with an error (no hung client) while the fleet recovers. The
fleet's Ray driver is a process of its own (``Driver``), never pytest's."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("ray", reason="Ray tests need the scale extra: pip install 'tinyserve-trt[scale]'")
pytest.importorskip("ray.serve", reason="Ray tests need ray[serve] (the scale extra)")

from tests.server import ray_driver  # noqa: E402
from tests.server.conftest import MODEL  # noqa: E402

KEY = "sk-ray-test"
SYSTEMS = [f"You are assistant number {i}; answer in one short sentence about tools. " for i in range(4)]
WARM = {"messages": [{"role": "system", "content": "Warm prompt: list three kinds of screws and nails."}]}
LONG = dict(model=MODEL, max_tokens=400, temperature=0, extra_body={"ignore_eos": True})


class Driver:
    """The fleet's Ray driver, a process of its own (tests/server/ray_driver.py: why)."""

    def __init__(self, args: dict):
        root = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.server.ray_driver", json.dumps(args)], cwd=root,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(ray_driver.PREFIX):
                self.lines.put(json.loads(line[len(ray_driver.PREFIX):]))
        self.lines.put(None)  # the driver exited

    def join(self, timeout: float) -> None:
        """Waits for the fleet: the driver's first reply says how to join its cluster."""
        first = self.reply(timeout)
        self.gcs_address, self.join_env = first["gcs_address"], first["env"]

    def reply(self, timeout: float):
        try:
            out = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the Ray driver did not answer in {timeout:.0f} s") from None
        assert out is not None, f"the Ray driver exited with {self.proc.wait()}"
        return out

    def stats(self) -> dict[str, dict]:
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        out = self.reply(120)
        if "error" in out:
            raise RuntimeError(out["error"])
        return out["stats"]

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            assert self.reply(120) == "BYE"
            assert self.proc.wait(timeout=120) == 0
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def fleet(llama):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    driver = Driver(dict(model_dir=str(llama[1]), num_cpus=2, warmup=[WARM], engine=dict(max_batch=8, threads=1),
                         config=dict(port=port, model_name=MODEL, timeout=120, api_key=KEY, max_queue=16,
                                     max_body_bytes=4096),
                         scale=dict(replicas=2, replica_cpus=1.0, route_pages=4)))
    try:
        driver.join(900)
        yield driver, f"http://127.0.0.1:{port}"
    finally:
        driver.close()


def _client(url, key=KEY):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_api_through_the_fleet(fleet):
    driver, url = fleet
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
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/v1/completions", headers={**auth, "content-type": "application/json"}, timeout=30,
                   # the replica's body limit
                   content=b'{"model": "tiny", "prompt": "' + b"x" * 5000 + b'"}')
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(url + "/v1/nothing", headers=auth, timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # no key needed
    assert httpx.get(url + "/metrics", timeout=30).status_code == 401
    from tinyserve_trt.runtime.server.metrics import parse_metrics

    m = parse_metrics(httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).text)
    assert m["tinyserve_replicas"] == 2
    per_replica = [k for k in m if k.startswith('tinyserve_kv_pages_total{replica=')]
    assert len(per_replica) == 2 and m["tinyserve_kv_pages_total"] == sum(m[k] for k in per_replica)
    assert "tinyserve_queue_depth" in m and "tinyserve_prefix_cache_hit_rate" in m


def test_the_fleet_driver_is_not_this_process(fleet):
    """Ray keeps its C++ threads (gRPC, the GCS client's io service) in a driver after
    ray.shutdown() until it exits: pytest's process must never be one (tests/server/ray_driver.py)."""
    import ray

    assert not ray.is_initialized()
    threads = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            threads.add((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    assert not threads & {"gcs_client_io_s", "worker.io", "event_engine", "grpc_global_tim"}, threads
    assert fleet[0].stats().keys()  # the driver answers


def test_warmup_ran_on_the_owner_and_its_first_request_hits(fleet):
    driver, url = fleet
    before = {rid: s["prefix_tokens_reused"] for rid, s in driver.stats().items()}
    raw = _client(url).chat.completions.with_raw_response.create(model=MODEL, messages=WARM["messages"],
                                                                  max_tokens=2)
    rid = raw.headers["x-tinyserve-replica"]
    after = driver.stats()
    assert after[rid]["prefix_tokens_reused"] - before[rid] >= 8  # the warmed pages were reused


def test_a_request_extending_the_warm_prefix_hits(fleet):
    # the request hashes more pages than the warm prefix has when that prefix is shorter than
    # route_pages pages (the warm-up then runs on every replica), or the same first pages
    driver, url = fleet
    before = {rid: s["prefix_tokens_reused"] for rid, s in driver.stats().items()}
    messages = WARM["messages"] + [{"role": "user", "content": "And which of them rust?"}]
    raw = _client(url).chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=2)
    rid = raw.headers["x-tinyserve-replica"]
    assert driver.stats()[rid]["prefix_tokens_reused"] - before[rid] >= 8


def test_requests_sharing_a_prefix_land_on_its_owner(fleet, llama):
    from tinyserve_trt.runtime.model_package import ModelPackage
    from tinyserve_trt.runtime.server.router import rendezvous_order, route_key
    from tinyserve_trt.runtime.server.warmup import prompt_token_ids

    driver, url = fleet
    package = ModelPackage.load(llama[1])
    ids = sorted(driver.stats())
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


def test_client_leaving_mid_stream_frees_the_replicas_pages(fleet):
    driver, url = fleet
    before = sum(s["decode_tokens"] for s in driver.stats().values())
    stream = _client(url).completions.create(prompt="a long answer please", stream=True, **LONG)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 30
    while True:
        stats = driver.stats()
        if all(s["pages_in_use"] == 0 for s in stats.values()):
            break
        assert time.monotonic() < deadline, {r: s["pages_in_use"] for r, s in stats.items()}
        time.sleep(0.2)
    time.sleep(1)
    decoded = sum(s["decode_tokens"] for s in driver.stats().values()) - before
    assert decoded < LONG["max_tokens"]  # aborted, not decoded to the end


def test_killed_replica_ends_its_streams_and_the_fleet_recovers(fleet):
    driver, url = fleet
    client = _client(url)
    pids = {rid: s["pid"] for rid, s in driver.stats().items()}
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
            stats = driver.stats()
        except Exception as e:  # a call to the dead replica before the router heard of its death
            stats = {"error": repr(e)}
        if len(stats) == 2 and victim not in stats:
            break
        assert time.monotonic() < deadline, f"no replacement replica: {list(stats)}"
        time.sleep(2)


# ---- routing and metrics units (no cluster) ------------------------------------------------

def test_route_key_is_the_chained_page_hash_of_the_leading_pages():
    from tinyserve_trt.runtime.prefix_cache import compute_hash
    from tinyserve_trt.runtime.server.router import route_key

    ids = list(range(40))
    assert route_key(ids[:3], 4, 2) is None  # under one page: no key
    assert route_key(ids, 4, 2) == compute_hash(ids[4:8], compute_hash(ids[:4], None)).hex()
    assert route_key(ids, 4, 2) == route_key(ids[:8] + [99] * 30, 4, 2)  # only the first pages count
    assert route_key(ids, 4, 2) != route_key([1] + ids[1:], 4, 2)
    assert route_key(ids[:6], 4, 2) == compute_hash(ids[:4], None).hex()  # fewer full pages: all of them


def test_rendezvous_owner_is_stable_and_moves_only_the_leavers_keys():
    from tinyserve_trt.runtime.server.router import rendezvous_order

    keys = [f"{i:032x}" for i in range(200)]
    three = {k: rendezvous_order(k, ["a", "b", "c"])[0] for k in keys}
    assert set(three.values()) == {"a", "b", "c"}
    two = {k: rendezvous_order(k, ["c", "a"])[0] for k in keys}  # b left; order of ids is irrelevant
    assert all(two[k] == three[k] for k in keys if three[k] != "b")


class _StubRouter:
    """What PrefixAwareRouter.choose_replicas reads of itself: queue lengths and the bound."""

    def __init__(self, queues, imbalance=4):
        from tinyserve_trt.runtime.server.router import PrefixAwareRouter

        self.queues, self.imbalance = queues, imbalance
        self._target = lambda c, p: PrefixAwareRouter._target(self, c, p)

    def _queue(self, replica):
        return self.queues.get(replica.replica_id.unique_id)


def _replica(uid):
    from types import SimpleNamespace

    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid))


def test_prefix_router_prefers_the_owner_until_it_is_busy():
    import asyncio
    from types import SimpleNamespace

    from tinyserve_trt.runtime.server.router import PrefixAwareRouter, rendezvous_order

    reps = [_replica(u) for u in ("r1", "r2", "r3")]
    key = "ab" * 16
    owner = rendezvous_order(key, ["r1", "r2", "r3"])[0]
    pending = SimpleNamespace(kwargs={"route_key": key})

    def choose(queues, request=pending):
        return asyncio.run(PrefixAwareRouter.choose_replicas(_StubRouter(queues), reps, request))

    ranks = choose({})  # nothing known: the owner alone first, the others as fallbacks
    assert [r.replica_id.unique_id for r in ranks[0]] == [owner] and len(ranks[1]) == 2
    assert choose({"r1": 3, "r2": 3, "r3": 3})[0][0].replica_id.unique_id == owner
    busy = {u: (9 if u == owner else 1) for u in ("r1", "r2", "r3")}
    first = choose(busy)[0]  # owner 8 requests ahead: power of two, the owner and one other
    assert len(first) == 2 and first[0].replica_id.unique_id == owner and first[1].replica_id.unique_id != owner
    assert len(choose({}, SimpleNamespace(kwargs={}))[0]) == 2  # no key: power of two
    targeted = choose({}, SimpleNamespace(kwargs={"replica": "r2"}))
    assert [[r.replica_id.unique_id for r in rank] for rank in targeted] == [["r2"]]


def test_merged_metrics_sum_counts_and_weight_rates():
    from tinyserve_trt.runtime.server.metrics import parse_metrics
    from tinyserve_trt.runtime.server.ray_metrics import merge

    def text(prompt, rate, free):
        return "\n".join(["# HELP tinyserve_prompt_tokens_total p", "# TYPE tinyserve_prompt_tokens_total counter",
                          f"tinyserve_prompt_tokens_total {prompt}",
                          "# HELP tinyserve_prefix_cache_hit_rate r", "# TYPE tinyserve_prefix_cache_hit_rate gauge",
                          f"tinyserve_prefix_cache_hit_rate {rate}",
                          "# HELP tinyserve_kv_pages k", "# TYPE tinyserve_kv_pages gauge",
                          f'tinyserve_kv_pages{{state="free"}} {free}',
                          "# HELP tinyserve_selected_page_rate s", "# TYPE tinyserve_selected_page_rate gauge",
                          "tinyserve_selected_page_rate NaN"]) + "\n"

    m = parse_metrics(merge({"a": text(300, 0.5, 10), "b": text(100, 0.1, 5)}))
    assert m["tinyserve_replicas"] == 2 and m["tinyserve_prompt_tokens_total"] == 400
    assert m["tinyserve_prefix_cache_hit_rate"] == pytest.approx((0.5 * 300 + 0.1 * 100) / 400)
    assert m['tinyserve_kv_pages{state="free"}'] == 15 and m['tinyserve_kv_pages{replica="b",state="free"}'] == 5
    assert m['tinyserve_prefix_cache_hit_rate{replica="a"}'] == 0.5


def test_scale_config_is_validated():
    from tinyserve_trt.runtime.server.ray_app import ScaleConfig

    for bad in (dict(replicas=0), dict(routing="random"), dict(route_pages=0), dict(imbalance=0),
                dict(replica_cpus=-1), dict(replica_gpus=float("nan")), dict(ray_address="")):
        with pytest.raises(ValueError):
            ScaleConfig(**bad)


def test_cli_replicas_joins_the_cluster_serves_and_stops_on_sigint(fleet, llama, tmp_path):
    """``tinyserve serve --ray-address ... --replicas 2`` (last: it replaces the fleet's app)."""
    driver, url = fleet
    root = Path(__file__).resolve().parents[2]
    warm = tmp_path / "warm.txt"
    warm.write_text("A warm prompt about the garden centre and its opening hours.\n")
    port = url.rsplit(":", 1)[1]  # Ray Serve's proxy keeps the port it started with
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
               **driver.join_env)  # Ray's token auth, as the driver's children have it
    cmd = [sys.executable, "-m", "tinyserve_trt.runtime.cli", "serve", str(llama[1]), "--replicas", "2",
           "--ray-address", driver.gcs_address, "--port", port, "--served-model-name", MODEL,
           "--api-key", KEY, "--replica-cpus", "0", "--threads", "1", "--max-batch", "4", "--warmup", str(warm)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # until the fleet is up
            lines.append(line)
            if line.startswith("tinyserve: serving 2 replicas"):
                break
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines[-30:])
        out = _client(url).completions.create(model=MODEL, prompt="A warm prompt about the garden centre",
                                              max_tokens=2)
        assert out.usage.completion_tokens >= 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0, "".join(lines[-10:]) + proc.stdout.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_shutdown_without_a_cluster_starts_none():
    """``serve --replicas`` whose deploy failed (e.g. Ray refused to join: no auth token) shuts the
    fleet down in a finally: with no cluster connected that must not start one (Serve's API
    auto-connects: it started a local Ray and then raised 'no Serve instance', hiding the error)."""
    root = Path(__file__).resolve().parents[2]
    code = ("import ray; from tinyserve_trt.runtime.server.ray_app import shutdown; "
            "shutdown(keep_cluster=True); shutdown(); print(ray.is_initialized())")
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.split() == ["False"], res.stderr[-2000:]
