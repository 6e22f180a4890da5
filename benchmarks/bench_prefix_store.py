"""KV pages beyond the pool (issue #33): TTFT of a returning prompt from the page store vs recomputed.

--prompts distinct system prompts of --prompt-tokens tokens go through a pool that holds
--pool-prompts of them, one request at a time (pass 1: every prompt's first visit). Pass 2:
each prompt returns with a new --question-tokens question. With more prompts than the pool
holds, a returning prompt's pages were evicted: without a store its prefix is recomputed;
with ``--kv-cache-dir`` (disk, plus ``--host-gb`` of host memory) it is read back. Then the
store's engine is closed and a NEW PROCESS (this script, ``--phase restart``) runs pass 2 on
the same directory. Greedy ids of every pass-2 request must be identical in the three runs.
Writes benchmarks/results/prefix_store.md; the LAST line printed is
``RESULT ttft_store_speedup=<recomputed p50 / store p50> ttft_restart_speedup=<... / restart p50>``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tinyserve_trt.runtime import SamplingParams  # noqa: E402
from tinyserve_trt.runtime.config import CacheConfig, EngineConfig  # noqa: E402
from tinyserve_trt.runtime.engine import Engine  # noqa: E402
from tinyserve_trt.runtime.model_package import ModelPackage  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def workload(package: ModelPackage, args) -> tuple[list[list[int]], list[list[int]]]:
    """(pass-1 prompts, pass-2 prompts): distinct system prompts + a question, a new one on return."""
    rng = np.random.default_rng(0)
    systems = [rng.integers(3, package.vocab_size, args.prompt_tokens).tolist() for _ in range(args.prompts)]
    ask = lambda: rng.integers(3, package.vocab_size, args.question_tokens).tolist()  # noqa: E731
    return [s + ask() for s in systems], [s + ask() for s in systems]


def engine(package: ModelPackage, args, store_dir: str | None) -> Engine:
    ps = package.page_size
    per_prompt = -(-(args.prompt_tokens + args.question_tokens + args.max_tokens) // ps)
    page = CacheConfig.page_bytes(ps, package.num_layers, package.num_kv_heads, package.head_dim, package.dtype)
    store = dict(kv_cache_dir=store_dir, kv_cache_max_gb=args.max_gb, kv_cache_host_gb=args.host_gb) if store_dir \
        else {}
    return Engine(package, EngineConfig(memory=args.pool_prompts * per_prompt * page + page, threads=args.threads,
                                        max_batch=1, dense=True, **store))


def one_by_one(eng: Engine, prompts: list[list[int]], max_tokens: int, tag: str) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ttfts, outputs, sources = [], [], []
    for i, p in enumerate(prompts):
        seq = eng.add_request(f"{tag}{i}", p, params)
        while not seq.is_finished:
            eng.step()
        ttfts.append(seq.stats.ttft)
        outputs.append(seq.output_token_ids)
        sources.append(seq.stats.prefix_source)
    return dict(ttft_p50=statistics.median(ttfts), ttft_mean=statistics.fmean(ttfts), outputs=outputs,
                sources={s: sources.count(s) for s in set(sources)})


def warm(eng: Engine) -> None:
    seq = eng.add_request("warm", [3] * 64, SamplingParams(max_tokens=2))  # first runs of a session are slow
    while not seq.is_finished:
        eng.step()


def run_pair(package: ModelPackage, args, store_dir: str | None) -> dict:
    """Pass 1 then pass 2 over one engine; with a store, the engine is closed (flushed) at the end."""
    eng = engine(package, args, store_dir)
    warm(eng)
    first, second = workload(package, args)
    one_by_one(eng, first, args.max_tokens, "a")
    t0 = time.perf_counter()
    out = one_by_one(eng, second, args.max_tokens, "b")
    out["pass2_s"] = time.perf_counter() - t0
    out["stats"] = eng.stats()
    eng.close()
    return out


def restart_phase(package: ModelPackage, args) -> dict:
    """A fresh process: pass 2 straight away on the store directory pass 1 filled."""
    t0 = time.perf_counter()
    eng = engine(package, args, args.dir)
    load_s = time.perf_counter() - t0
    warm(eng)
    _, second = workload(package, args)
    out = one_by_one(eng, second, args.max_tokens, "b")
    out["stats"] = {k: v for k, v in eng.stats().items() if k.startswith(("kv_store", "prefix_pages"))}
    out["engine_start_s"] = load_s
    eng.backend.close()  # not close(): the directory is left as the run before left it
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="tinyserve package (tinyserve-export output)")
    ap.add_argument("--prompts", type=int, default=64, help="distinct system prompts")
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="tokens of each system prompt")
    ap.add_argument("--question-tokens", type=int, default=16, help="tokens of each (new) question")
    ap.add_argument("--pool-prompts", type=int, default=8, help="system prompts the KV pool holds")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--host-gb", type=float, default=0.0, help="host-memory tier above the disk store (GiB)")
    ap.add_argument("--max-gb", type=float, default=64.0, help="disk store bound (GiB)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dir", default=None, help="store directory (default: a fresh temporary one, removed after)")
    ap.add_argument("--phase", choices=("all", "restart"), default="all", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=RESULTS / "prefix_store.md")
    ap.add_argument("--note", default="", help="a line added to the table (e.g. the machine was shared)")
    args = ap.parse_args(argv)
    if args.prompts <= args.pool_prompts:
        ap.error("--prompts must exceed --pool-prompts (else nothing is evicted)")
    package = ModelPackage.load(args.model)
    if args.phase == "restart":
        print(json.dumps(restart_phase(package, args)))
        return 0
    tmp = None
    if args.dir is None:
        tmp = args.dir = tempfile.mkdtemp(prefix="kvstore-bench-")
    try:
        recomputed = run_pair(package, args, None)
        print(f"recomputed: pass-2 TTFT p50 {recomputed['ttft_p50'] * 1e3:.1f} ms", flush=True)
        stored = run_pair(package, args, args.dir)
        print(f"store: pass-2 TTFT p50 {stored['ttft_p50'] * 1e3:.1f} ms, sources {stored['sources']}", flush=True)
        cmd = [sys.executable, __file__, "--phase", "restart", *_forward(args)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        restart = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"restart: pass-2 TTFT p50 {restart['ttft_p50'] * 1e3:.1f} ms, sources {restart['sources']}",
              flush=True)
        disk_bytes = sum(f.stat().st_size for f in Path(args.dir).rglob("*.kvp"))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    same = recomputed["outputs"] == stored["outputs"] == restart["outputs"]
    print(f"pass-2 greedy ids identical (recomputed / store / restart): {same}")
    write_table(args, package, recomputed, stored, restart, same, disk_bytes)
    print(f"RESULT ttft_store_speedup={recomputed['ttft_p50'] / stored['ttft_p50']:.2f} "
          f"ttft_restart_speedup={recomputed['ttft_p50'] / restart['ttft_p50']:.2f}")
    return 0 if same else 1


def _forward(args) -> list[str]:
    return ["--model", str(args.model), "--prompts", str(args.prompts), "--prompt-tokens", str(args.prompt_tokens),
            "--question-tokens", str(args.question_tokens), "--pool-prompts", str(args.pool_prompts),
            "--max-tokens", str(args.max_tokens), "--host-gb", str(args.host_gb), "--max-gb", str(args.max_gb),
            "--threads", str(args.threads), "--dir", args.dir]


def write_table(args, package, recomputed, stored, restart, same, disk_bytes) -> None:
    import onnxruntime as ort

    s = stored["stats"]
    moved = s.get("kv_store_disk_hit_bytes", 0) + s.get("kv_store_host_hit_bytes", 0)
    rows = [("recomputed (no store)", recomputed), ("page store, same process", stored),
            ("page store, new process (restart)", restart)]
    lines = [
        "# KV pages beyond the pool: returning prompts from the page store vs recomputed",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {args.threads} ORT threads; onnxruntime "
        f"{ort.__version__}. Model: `{package.manifest.get('model_name', package.path.name)}` (page "
        f"{package.page_size}, {package.dtype}, {package.num_layers} layers). {args.prompts} distinct "
        f"{args.prompt_tokens}-token system prompts, a pool holding {args.pool_prompts} of them, one request at a "
        f"time; pass 2 brings every prompt back with a new {args.question_tokens}-token question, "
        f"{args.max_tokens} greedy tokens each. Store: disk (`--kv-cache-dir`, page cache warm)"
        f"{f' under {args.host_gb} GiB of host memory' if args.host_gb else ''}. Command: `python "
        f"benchmarks/bench_prefix_store.py --model {args.model} --prompts {args.prompts} --prompt-tokens "
        f"{args.prompt_tokens} --pool-prompts {args.pool_prompts}{f' --host-gb {args.host_gb}' if args.host_gb else ''}`.",
        *(["", args.note] if args.note else []),
        "",
        "| pass 2 (returning prompts) | TTFT p50 (ms) | TTFT mean (ms) | prefix came from |",
        "|---|---|---|---|",
    ]
    for name, r in rows:
        src = ", ".join(f"{k} {v}" for k, v in sorted(r["sources"].items()))
        lines.append(f"| {name} | {r['ttft_p50'] * 1e3:.1f} | {r['ttft_mean'] * 1e3:.1f} | {src} |")
    lines += ["", f"TTFT p50 speedup vs recomputed: store {recomputed['ttft_p50'] / stored['ttft_p50']:.2f}x, "
              f"after a restart {recomputed['ttft_p50'] / restart['ttft_p50']:.2f}x. Pass-2 greedy ids identical in "
              f"the three runs: {same}. Bytes read from the store in pass 2: {moved / 2**20:.1f} MiB; store on disk "
              f"after the runs: {disk_bytes / 2**20:.1f} MiB; the restarted engine started in "
              f"{restart['engine_start_s']:.2f} s (index scan included)."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
