"""Prefix sharing: KV pages in use and time to first token, with and without it.

--requests requests share a --prefix-token prefix and add --unique tokens of
their own (a system prompt + a question). The first request arrives alone;
the rest arrive once its first token is out (its prefix pages are then in
the cache). Both runs use the same engine settings but for the prefix cache
(``hash`` vs ``none``). Pages: the peak of pages in use over the run. TTFT:
mean over the requests that arrived together, arrival to first token.
Writes benchmarks/results/prefix_cpu.md; the LAST line printed is
``RESULT pages_ratio=<shared/unshared> ttft_speedup=<unshared/shared>``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tinyserve_trt.runtime import SamplingParams  # noqa: E402
from tinyserve_trt.runtime.config import CacheConfig, EngineConfig  # noqa: E402
from tinyserve_trt.runtime.engine import Engine  # noqa: E402
from tinyserve_trt.runtime.model_package import ModelPackage  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def run(package: ModelPackage, prompts: list[list[int]], sharing: bool, max_tokens: int, threads: int,
        budget: int | None) -> dict:
    ps = package.page_size
    pages = sum(-(-(len(p) + max_tokens + 1) // ps) for p in prompts) + 8
    page_bytes = CacheConfig.page_bytes(ps, package.num_layers, package.num_kv_heads, package.head_dim, package.dtype)
    engine = Engine(package, EngineConfig(prefix_sharing=sharing, memory=pages * page_bytes, threads=threads,
                                          max_batch=len(prompts), token_budget=budget))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    warm = engine.add_request("warmup", [3] * min(len(prompts[-1]), 64), SamplingParams(max_tokens=2))
    while not warm.is_finished:  # first runs of a session are slow: keep them out of the TTFTs
        engine.step()
    first = engine.add_request("r0", prompts[0], params)
    peak = 0
    while first.num_output_tokens == 0:
        engine.step()
        peak = max(peak, engine.stats()["pages_in_use"])
    rest = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts[1:], 1)]
    outputs = {}
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.stats()["pages_in_use"])
    for s in [first, *rest]:
        outputs[s.request_id] = s.output_token_ids
    stats = engine.stats()
    engine.close()
    return dict(peak_pages=peak, ttft=statistics.mean(s.stats.ttft for s in rest), first_ttft=first.stats.ttft,
                reused=statistics.mean(s.stats.prefix_pages_reused for s in rest), outputs=outputs,
                hit_rate=stats["prefix_hit_rate"], prefill_tokens=stats["prefill_tokens"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="tinyserve package (tinyserve-export output)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens")
    ap.add_argument("--unique", type=int, default=32, help="tokens of each request's own")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--budget", type=int, help="decode token budget (default: the package's)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", type=Path, default=RESULTS / "prefix_cpu.md")
    args = ap.parse_args(argv)
    if args.requests < 2:
        ap.error("--requests must be >= 2 (one arrives first, the others share its prefix)")
    package = ModelPackage.load(args.model)
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, package.vocab_size, args.prefix).tolist()
    prompts = [prefix + rng.integers(3, package.vocab_size, args.unique).tolist() for _ in range(args.requests)]
    shared = run(package, prompts, True, args.max_tokens, args.threads, args.budget)
    unshared = run(package, prompts, False, args.max_tokens, args.threads, args.budget)
    same = shared["outputs"] == unshared["outputs"]
    pages_ratio = shared["peak_pages"] / unshared["peak_pages"]
    ttft_speedup = unshared["ttft"] / shared["ttft"]
    for name, r in (("shared", shared), ("unshared", unshared)):
        print(f"{name}: peak pages {r['peak_pages']}, mean TTFT {r['ttft'] * 1e3:.1f} ms, prefix pages reused "
              f"{r['reused']:.1f}, prefill tokens {r['prefill_tokens']}", flush=True)
    print(f"outputs identical with and without sharing: {same}")
    write_table(args, package, shared, unshared, same)
    print(f"RESULT pages_ratio={pages_ratio:.3f} ttft_speedup={ttft_speedup:.2f}")
    return 0 if same else 1


def write_table(args, package, shared, unshared, same) -> None:
    import onnxruntime as ort

    lines = [
        "# Prefix sharing on CPU: KV pages and time to first token",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {args.threads} ORT threads; onnxruntime "
        f"{ort.__version__}. Model: `{package.path.name}` (page {package.page_size}). {args.requests} requests = "
        f"{args.prefix}-token shared prefix + {args.unique} unique tokens, {args.max_tokens} tokens each; the "
        f"first arrives alone, the other {args.requests - 1} together once its first token is out. Command: "
        f"`python benchmarks/bench_prefix.py --model {args.model} --requests {args.requests} --prefix "
        f"{args.prefix} --unique {args.unique}`.",
        "",
        "| prefix cache | peak KV pages in use | mean TTFT of the later requests (ms) | first request TTFT (ms) "
        "| prefill tokens computed |",
        "|---|---|---|---|---|",
    ]
    for name, r in (("hash (sharing)", shared), ("none", unshared)):
        lines.append(f"| {name} | {r['peak_pages']} | {r['ttft'] * 1e3:.1f} | {r['first_ttft'] * 1e3:.1f} | "
                     f"{r['prefill_tokens']} |")
    lines += ["", f"Pages ratio (shared / unshared): {shared['peak_pages'] / unshared['peak_pages']:.3f}; "
              f"TTFT speedup: {unshared['ttft'] / shared['ttft']:.2f}x; generated tokens identical: {same}."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
