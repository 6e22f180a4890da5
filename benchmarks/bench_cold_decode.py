"""Decode step of a cold-tier package on CPU: the native kernel vs the op's ONNX function.

One package exported with a cold tier (``tinyserve-export --cold-pages [int8|int4]``), timed in one
process two ways, alternating within each pass: ``kernel`` - ``model.ort.onnx``, whose decode steps
run the native CPU node (``tinyserve_trt/cpu``; it dequantizes only the kept cold rows) - and
``function`` - the same package with ``TINYSERVE_NATIVE=0``, so the runtime loads ``model.onnx``
and the op runs as its inlined ONNX function. The engine demotes pages to the cold tier as it
serves (the package's hot fraction), as in production; the table gives the cold pages at the end.
Decode steps are timed as ``bench_decode.time_tinyserve`` (median of --steps, best of --passes).
Writes benchmarks/results/cold_decode_cpu.md; the LAST line printed is
``RESULT kernel_over_function=<kernel / function sparse step at the largest context and batch>``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import RESULTS, prompts, time_tinyserve  # noqa: E402
from tinyserve_trt.cpu import native  # noqa: E402
from tinyserve_trt.runtime.model_package import ModelPackage  # noqa: E402

MODES = ("kernel", "function")


def timed(package: ModelPackage, mode: str, rows, args) -> tuple[dict, dict]:
    stats: dict = {}
    old = os.environ.get(native.ENV_DISABLE)
    if mode == "function":
        os.environ[native.ENV_DISABLE] = "0"
    try:
        res = time_tinyserve(package, rows, {"sparse": args.budget, "dense": 0}, args.steps, args.threads,
                             stats=stats)
    finally:
        if old is None:
            os.environ.pop(native.ENV_DISABLE, None)
        else:
            os.environ[native.ENV_DISABLE] = old
    return res, stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a package with a cold tier")
    ap.add_argument("--contexts", default="8000")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", type=Path, default=RESULTS / "cold_decode_cpu.md")
    args = ap.parse_args(argv)
    package = ModelPackage.load(args.model)
    if package.cold_tier is None:
        ap.error(f"{args.model} has no cold tier (export it with --cold-pages)")
    opt = package.spec.ort_optimized
    if opt is None or not opt.native:
        ap.error(f"{args.model}'s model.ort.onnx does not decode on the native kernel (re-export it)")
    reason = native.available()
    if reason:
        ap.error(f"the native kernel is unavailable: {reason}")
    rows_out = []
    for context in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            rows = prompts(package.vocab_size, context, batch)
            best: dict[str, dict[str, float]] = {}
            cold: dict[str, int] = {}
            for _ in range(args.passes):
                for mode in MODES:
                    res, stats = timed(package, mode, rows, args)
                    cur = best.setdefault(mode, {})
                    for k, v in res.items():
                        cur[k] = min(cur.get(k, float("inf")), v)
                    cold[mode] = stats.get("pages_cold", 0)
            rows_out.append((context, batch, best, cold))
            print(f"context {context} batch {batch}: " + " ".join(
                f"{m}: sparse={b['sparse'] * 1e3:.1f}ms dense={b['dense'] * 1e3:.1f}ms cold={cold[m]}"
                for m, b in best.items()), flush=True)
    write(args, package, rows_out)
    _, _, best, _ = rows_out[-1]
    print(f"RESULT kernel_over_function={best['kernel']['sparse'] / best['function']['sparse']:.2f}")
    return 0


def write(args, package: ModelPackage, rows) -> None:
    import platform

    import onnxruntime as ort

    tier = package.cold_tier
    lines = ["# Cold-tier decode on CPU: the native kernel vs the op's ONNX function", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, {args.threads} ORT threads; onnxruntime "
             f"{ort.__version__}. Package `{args.model.name}`: page {package.page_size}, sub-page "
             f"{package.sub_page_size}, cold format {tier['cold_format']}, hot fraction {tier['hot_fraction']}. "
             f"Budget {args.budget} tokens. Command: `python benchmarks/bench_cold_decode.py --model {args.model} "
             f"--contexts {args.contexts} --batches {args.batches} --passes {args.passes} --steps {args.steps} "
             f"--threads {args.threads}` (median of {args.steps} "
             "decode steps, best of the passes, modes alternating; cold pages = the pool's cold pages at the end).", "",
             "| context | batch | kernel sparse ms | kernel dense ms | function sparse ms | function dense ms | "
             "cold pages | kernel / function (sparse) |", "|---|---|---|---|---|---|---|---|"]
    for context, batch, best, cold in rows:
        k, f = best["kernel"], best["function"]
        lines.append(f"| {context} | {batch} | {k['sparse'] * 1e3:.1f} | {k['dense'] * 1e3:.1f} | "
                     f"{f['sparse'] * 1e3:.1f} | {f['dense'] * 1e3:.1f} | {cold['kernel']} | "
                     f"{k['sparse'] / f['sparse']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
