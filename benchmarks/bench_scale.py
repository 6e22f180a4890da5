"""Scale-out on Ray Serve: prefix-aware routing vs Ray Serve's default, and 1 replica vs 2.

One local Ray cluster (``--num-cpus``), three deployments of ``--model`` one after the
other on it: 2 replicas with prefix-aware routing, 2 replicas with Ray Serve's default
routing (power of two choices), 1 replica. Each run sends ``--systems`` system prompts x
``--requests`` streaming chat requests (a different question each, shuffled with a fixed
seed) from ``--concurrency`` clients, after one unmeasured request per system prompt.
Reported per run: throughput (generated tokens / wall s), client-side TTFT p50/p99,
the fleet's prefix hit rate over the run (prompt tokens whose prefill the prefix cache
skipped / prompt tokens, from each replica's engine counters) and how the requests
spread over the replicas. ORT threads per replica: ``--threads``, else the cluster's CPUs
split between the replicas (2 replicas on 2 CPUs: 1 thread each; 1 replica: 2).
Then cache warm-up: 2 replicas with prefix routing, deployed once without and once with
``--warmup`` (the system prompts), each sent the first request of every system prompt one
at a time: the TTFT of a prefix's first request, cold vs warm. Writes ``--out`` (markdown) and the same numbers as JSON next
to it; the LAST line printed is
``RESULT hit_rate_prefix=<x> hit_rate_default=<y> tok_s_2v1=<2 replicas / 1 replica>
ttft_warm_over_cold=<first-request TTFT with / without warm-up>``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]
from bench_serve import MODEL, SYSTEM, one_request, percentile  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
RUNS = (("prefix", 2), ("default", 2), ("prefix", 1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def systems(n: int, chars: int) -> list[str]:
    base = (SYSTEM * (chars // len(SYSTEM) + 1))[:chars]
    return [f"[shop {i}] " + base for i in range(n)]


async def load(url: str, work: list[tuple[str, str]], warm: list[str], concurrency: int, max_tokens: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        for system in warm:  # one unmeasured request per system prompt
            await one_request(client, url, system, "warm up", 2)
        queue = iter(work)
        results = []

        async def worker():
            for system, question in queue:
                results.append(await one_request(client, url, system, question, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return dict(requests=len(results), output_tokens=tokens, wall_s=wall, tok_s=tokens / wall,
                ttft_p50_ms=1e3 * statistics.median(ttfts), ttft_p99_ms=1e3 * percentile(ttfts, 0.99))


async def first_requests(url: str, prompts: list[str], max_tokens: int) -> list[float]:
    """TTFT (s) of the first request of each system prompt, sent one at a time."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        return [(await one_request(client, url, s, f"First question ({i})", max_tokens))["ttft"]
                for i, s in enumerate(prompts)]


def threads_for(args, replicas: int) -> int:
    return args.threads or max(1, args.num_cpus // replicas)


def deployed(args, port: int, routing: str, replicas: int, queue: int, warmup=()):
    from tinyserve_trt.runtime.server import ServerConfig
    from tinyserve_trt.runtime.server.ray_app import ScaleConfig, deploy

    config = ServerConfig(port=port, model_name=MODEL, timeout=None, max_queue=queue)
    engine = dict(max_batch=args.max_batch, threads=threads_for(args, replicas))
    scale = ScaleConfig(replicas=replicas, routing=routing, replica_cpus=args.replica_cpus)
    return deploy(args.model, config, scale, engine, warmup)


def run_warmup(args, port: int, prompts: list[str], warm: bool) -> dict:
    from ray import serve

    from tinyserve_trt.runtime.server.ray_app import APP

    items = [{"messages": [{"role": "system", "content": s}]} for s in prompts] if warm else []
    handle = deployed(args, port, "prefix", 2, len(prompts), items)
    try:
        stats0 = handle.stats.remote().result(timeout_s=120)
        ttfts = asyncio.run(first_requests(f"http://127.0.0.1:{port}", prompts, args.max_tokens))
        stats1 = handle.stats.remote().result(timeout_s=120)
    finally:
        serve.delete(APP)
    prompt = sum(s["prompt_tokens"] - stats0[r]["prompt_tokens"] for r, s in stats1.items())
    reused = sum(s["prefix_tokens_reused"] - stats0[r]["prefix_tokens_reused"] for r, s in stats1.items())
    return dict(warmup=warm, requests=len(ttfts), ttft_ms=[round(1e3 * t, 1) for t in ttfts],
                ttft_mean_ms=1e3 * statistics.fmean(ttfts), prefix_hit_rate=reused / prompt if prompt else 0.0)


def run_one(args, port: int, routing: str, replicas: int, work, warm) -> dict:
    from ray import serve

    from tinyserve_trt.runtime.server.ray_app import APP

    handle = deployed(args, port, routing, replicas, len(work))
    try:
        url = f"http://127.0.0.1:{port}"
        stats0 = handle.stats.remote().result(timeout_s=120)
        row = asyncio.run(load(url, work, warm, args.concurrency, args.max_tokens))
        stats1 = handle.stats.remote().result(timeout_s=120)
    finally:
        serve.delete(APP)
    prompt = sum(s["prompt_tokens"] - stats0[r]["prompt_tokens"] for r, s in stats1.items())
    reused = sum(s["prefix_tokens_reused"] - stats0[r]["prefix_tokens_reused"] for r, s in stats1.items())
    share = sorted((s["prompt_tokens"] - stats0[r]["prompt_tokens"] for r, s in stats1.items()), reverse=True)
    return dict(routing=routing, replicas=replicas, threads=threads_for(args, replicas),
                prefix_hit_rate=reused / prompt if prompt else 0.0, prompt_tokens_by_replica=share, **row)


def write(rows: list[dict], warm_rows: list[dict], args, meta: dict, out: Path) -> None:
    lines = [f"# Scale-out on Ray Serve ({meta['model']})", "",
             f"`python benchmarks/bench_scale.py --model {args.model} --systems {args.systems} --requests "
             f"{args.requests} --concurrency {args.concurrency} --max-tokens {args.max_tokens} --system-chars "
             f"{args.system_chars} --num-cpus {args.num_cpus}` on {meta['machine']}, {meta['cpus']} CPUs; one "
             "local Ray cluster, clients on the same machine. Hit rate: prompt tokens whose prefill the "
             "replicas' prefix caches skipped / prompt tokens (engine counters over the measured requests). "
             "TTFT: client side, HTTP included.", "",
             "| routing | replicas | ORT threads each | requests | tok/s | TTFT p50 ms | TTFT p99 ms | "
             "prefix hit rate | prompt tokens per replica |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['routing']} | {r['replicas']} | {r['threads']} | {r['requests']} | {r['tok_s']:.1f} | "
                     f"{r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['prefix_hit_rate']:.3f} | "
                     f"{', '.join(map(str, r['prompt_tokens_by_replica']))} |")
    lines += ["", "Cache warm-up (2 replicas, prefix routing): the first request of each system prompt, "
              "one at a time, after a deployment without and with `--warmup` (the system prompts).", "",
              "| warm-up | requests | TTFT mean ms | TTFT per request ms | prefix hit rate |", "|---|---|---|---|---|"]
    for r in warm_rows:
        lines.append(f"| {'yes' if r['warmup'] else 'no'} | {r['requests']} | {r['ttft_mean_ms']:.1f} | "
                     f"{', '.join(map(str, r['ttft_ms']))} | {r['prefix_hit_rate']:.3f} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "warmup": warm_rows}, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="package written by tinyserve-export")
    p.add_argument("--systems", type=int, default=4, help="distinct system prompts")
    p.add_argument("--requests", type=int, default=64, help="requests per system prompt")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--system-chars", type=int, default=600)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="ORT threads per replica")
    p.add_argument("--num-cpus", type=int, default=os.cpu_count(), help="CPUs of the local Ray cluster")
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "scale_cpu.md")
    args = p.parse_args(argv)
    import ray

    prompts = systems(args.systems, args.system_chars)
    work = [(s, f"Where are the apples? ({i})") for s in prompts for i in range(args.requests)]
    random.Random(args.seed).shuffle(work)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, logging_level="WARNING")
    load0 = os.getloadavg()[0]
    try:
        port = free_port()  # Ray Serve's proxy keeps the port it started on: one for all runs
        rows = [run_one(args, port, routing, replicas, work, prompts) for routing, replicas in RUNS]
        warm_rows = [run_warmup(args, port, prompts, warm) for warm in (False, True)]
    finally:
        if started:
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    meta = dict(model=Path(args.model).name, machine=platform.machine(), cpus=os.cpu_count(),
                load_avg_1min=[round(load0, 2), round(os.getloadavg()[0], 2)], ray=ray.__version__)
    write(rows, warm_rows, args, meta, args.out)
    for r in rows:
        print(f"{r['routing']:>7} x{r['replicas']}: {r['tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_ms']:.1f} ms "
              f"p99 {r['ttft_p99_ms']:.1f} ms, prefix hit rate {r['prefix_hit_rate']:.3f}")
    for r in warm_rows:
        print(f"warm-up {'yes' if r['warmup'] else 'no '}: first-request TTFT mean {r['ttft_mean_ms']:.1f} ms, "
              f"prefix hit rate {r['prefix_hit_rate']:.3f}")
    by = {(r["routing"], r["replicas"]): r for r in rows}
    print(f"RESULT hit_rate_prefix={by['prefix', 2]['prefix_hit_rate']:.3f} "
          f"hit_rate_default={by['default', 2]['prefix_hit_rate']:.3f} "
          f"tok_s_2v1={by['prefix', 2]['tok_s'] / by['prefix', 1]['tok_s']:.3f} "
          f"ttft_warm_over_cold={warm_rows[1]['ttft_mean_ms'] / warm_rows[0]['ttft_mean_ms']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
