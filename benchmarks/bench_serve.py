"""The HTTP server under concurrent streaming clients: throughput and TTFT.

Starts ``tinyserve serve --model`` as a subprocess on a free 127.0.0.1 port and
drives ``POST /v1/chat/completions`` (stream, ``ignore_eos`` so every answer is
``--max-tokens`` long) from ``c`` concurrent clients for each ``c`` in
``--concurrency``, each client sending ``--rounds`` requests one after the other.
Two prompt sets: every request carries the same ``--system-chars`` system prompt
(``shared``: its pages come from the prefix cache after the first request) or a
system prompt of the same length made unique by a leading tag (``unique``).
TTFT: request sent to the first streamed token (client side, HTTP included);
throughput: generated tokens / wall time of the run. A warm-up request precedes
each run. Writes ``--out`` (markdown) and the same numbers as JSON next to it; the
LAST line printed is ``RESULT tok_s_c<max>_shared=<x> ttft_p50_speedup_c<max>=<unique/shared>``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tinyserve_dev.serve_process import metrics, start_serve  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODEL = "bench"
SYSTEM = ("You are a concise assistant for a small shop. Answer in one sentence, name the aisle when asked "
          "where something is, and never invent prices. ")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def start_server(model: str, max_batch: int, threads: int | None, extra: list[str]) -> tuple[subprocess.Popen, str]:
    return start_serve(model, "--served-model-name", MODEL, "--max-batch", str(max_batch), "--timeout", "0",
                       "--log-level", "warning", *(["--threads", str(threads)] if threads else []), *extra,
                       timeout=300)


async def one_request(client, url: str, system: str, question: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            choices = chunk.get("choices") or []
            if ttft is None and choices and (choices[0]["delta"].get("content") or choices[0]["finish_reason"]):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return dict(ttft=ttft if ttft is not None else time.perf_counter() - t0, latency=time.perf_counter() - t0,
                tokens=tokens)


async def run_level(url: str, clients: int, rounds: int, shared: bool, system_chars: int, max_tokens: int,
                    tag: str) -> dict:
    import httpx

    base = (SYSTEM * (system_chars // len(SYSTEM) + 1))[:system_chars]

    def system(i: int) -> str:
        return base if shared else f"[{tag}-{clients}-{i}] " + base[:max(0, system_chars - 16)]

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await one_request(client, url, system(-1), "warm up", 2)  # shared: fills the prefix cache
        counter = iter(range(clients * rounds))
        results = []

        async def worker():
            for i in counter:
                results.append(await one_request(client, url, system(i), f"Where are the apples? ({i})",
                                                 max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return dict(prompt="shared" if shared else "unique", clients=clients, requests=len(results),
                output_tokens=tokens, wall_s=wall, tok_s=tokens / wall, req_s=len(results) / wall,
                ttft_p50_ms=1e3 * statistics.median(ttfts), ttft_p99_ms=1e3 * percentile(ttfts, 0.99),
                latency_mean_s=statistics.mean(r["latency"] for r in results))


def write(rows: list[dict], args, meta: dict, out: Path) -> None:
    lines = [f"# Server: concurrent streaming chat clients ({meta['model']})", "",
             f"`python benchmarks/bench_serve.py --model {args.model} --concurrency {args.concurrency} "
             f"--rounds {args.rounds} --system-chars {args.system_chars} --max-tokens {args.max_tokens}"
             f"{' --threads ' + str(args.threads) if args.threads else ''}` on {meta['machine']}, "
             f"{meta['cpus']} CPUs (1-min load average {meta['load_avg_1min'][0]} before, "
             f"{meta['load_avg_1min'][1]} after: other jobs share them); server and clients on the same "
             "machine.", "",
             f"System prompt: {meta['system_tokens']} tokens of {meta['prompt_tokens']} per request; "
             f"{args.max_tokens} generated tokens per request (ignore_eos, greedy). TTFT is client-side "
             "(request sent -> first streamed token). `shared`: the same system prompt in every request "
             "(prefix cache hit after the warm-up); `unique`: the same length, different first tokens.", "",
             "| prompt | clients | requests | output tok/s | req/s | TTFT p50 (ms) | TTFT p99 (ms) | mean latency (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['prompt']} | {r['clients']} | {r['requests']} | {r['tok_s']:.1f} | {r['req_s']:.2f} | "
                     f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['latency_mean_s']:.2f} |")
    lines += ["", "| clients | TTFT p50 unique / shared | tok/s shared / unique |", "|---:|---:|---:|"]
    for c in sorted({r["clients"] for r in rows}):
        s = next(r for r in rows if r["clients"] == c and r["prompt"] == "shared")
        u = next(r for r in rows if r["clients"] == c and r["prompt"] == "unique")
        lines.append(f"| {c} | {u['ttft_p50_ms'] / s['ttft_p50_ms']:.2f}x | {s['tok_s'] / u['tok_s']:.2f}x |")
    lines += ["", f"After the runs the server reported: pages used {meta['pages_used_after']:.0f}, "
              f"prefix hit rate {meta['prefix_hit_rate']:.2f}, selected-page rate "
              f"{meta['selected_page_rate']:.2f}, errors (4xx/5xx) {meta['errors']:.0f}.", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="package directory")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts")
    p.add_argument("--rounds", type=int, default=2, help="requests per client, one after the other")
    p.add_argument("--system-chars", type=int, default=800, help="length of the system prompt")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="backend threads (default: the backend's)")
    p.add_argument("--out", type=Path, default=RESULTS / "serve_cpu.md")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    load_before = os.getloadavg()[0]
    proc, url = start_server(args.model, max(levels), args.threads, [])
    rows = []
    try:
        for c in levels:
            for shared in (True, False):
                row = asyncio.run(run_level(url, c, args.rounds, shared, args.system_chars, args.max_tokens,
                                            tag=str(time.time_ns())))
                rows.append(row)
                print(f"{row['prompt']:>6} c={c:<3} {row['tok_s']:8.1f} tok/s  TTFT p50 {row['ttft_p50_ms']:7.0f} ms"
                      f"  p99 {row['ttft_p99_ms']:7.0f} ms", flush=True)
        m = metrics(url, timeout=60)
    finally:
        proc.send_signal(2)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    from tinyserve_trt.runtime.model_package import ModelPackage

    package = ModelPackage.load(args.model)
    base = (SYSTEM * (args.system_chars // len(SYSTEM) + 1))[:args.system_chars]
    msgs = [{"role": "system", "content": base}, {"role": "user", "content": "Where are the apples? (0)"}]
    meta = dict(model=Path(args.model).resolve().name, machine=platform.processor() or platform.machine(),
                cpus=os.cpu_count(), system_tokens=len(package.encode(base, add_special_tokens=False)),
                prompt_tokens=len(package.encode(package.apply_chat_template(msgs), add_special_tokens=False)),
                load_avg_1min=[round(load_before, 2), round(os.getloadavg()[0], 2)],
                pages_used_after=m['tinyserve_kv_pages{state="used"}'], prefix_hit_rate=m["tinyserve_prefix_cache_hit_rate"],
                selected_page_rate=m["tinyserve_selected_page_rate"],
                errors=sum(v for k, v in m.items() if k.startswith("tinyserve_requests_total{")
                           and not k.endswith('status="200"}')))
    write(rows, args, meta, args.out)
    top = max(levels)
    s = next(r for r in rows if r["clients"] == top and r["prompt"] == "shared")
    u = next(r for r in rows if r["clients"] == top and r["prompt"] == "unique")
    print(f"RESULT tok_s_c{top}_shared={s['tok_s']:.2f} ttft_p50_speedup_c{top}={u['ttft_p50_ms'] / s['ttft_p50_ms']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
