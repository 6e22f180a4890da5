"""Where sparse decode starts to pay: one step of the package's ORT graph, sparse vs dense.

Chooses ``EngineConfig.sparse_min_ratio`` (runtime/config.py): below that many times
its budget a sequence decodes dense. For each (context, batch) one ORT session over the
package's ``model.ort.onnx`` runs a decode step on a random page pool (``profile_decode.
ours_feeds``: every row ``context`` cached tokens, one new token) twice - budget
``--budget`` (the op selects) and budget 0 (the op's dense branch, what the rule picks) -
interleaved step by step on the same pool, each timed run after an untimed one of the same
feeds. Random keys change which pages are picked, not what selecting costs. Reports the
median step times and sparse / dense (< 1: sparse is faster).
Writes benchmarks/results/sparse_threshold.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode import ours_feeds, session, wall  # noqa: E402
from tinyserve_trt.runtime.model_package import ModelPackage  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def sparse_vs_dense(sess, package: ModelPackage, context: int, batch: int, budget: int,
                    steps: int) -> tuple[float, float]:
    """Median seconds per step (sparse at ``budget``, dense), interleaved (``profile_decode.wall``)."""
    sparse = ours_feeds(package, context, batch, budget)
    dense = {**sparse, package.inputs["token_budget"]: np.zeros(batch, np.int32)}
    med = wall({"sparse": sess, "dense": sess}, {"sparse": sparse, "dense": dense}, steps)
    return med["sparse"], med["dense"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="tinyserve package (tinyserve-export output)")
    ap.add_argument("--contexts", default="1040,1536,2048,3072,4096",
                    help="cached tokens per row (1040: a 1K prompt mid-decode; at 1024 the op runs dense itself)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "sparse_threshold.md")
    ap.add_argument("--note", default="", help="a line for the table's header (e.g. what else ran)")
    args = ap.parse_args(argv)
    if not (args.model / "tinyserve.json").is_file():
        print(f"error: {args.model} is not a tinyserve package", file=sys.stderr)
        return 2
    if args.budget <= 0 or args.steps <= 0:
        print("error: --budget and --steps must be positive", file=sys.stderr)
        return 2
    import onnxruntime as ort

    package = ModelPackage.load(args.model)
    sess = session(package.ort_model_path(ort.__version__), args.threads)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            s, d = sparse_vs_dense(sess, package, context, batch, args.budget, args.steps)
            rows.append((context, batch, s, d))
            print(f"context {context} batch {batch}: sparse {s * 1e3:.1f} ms, dense {d * 1e3:.1f} ms, "
                  f"sparse/dense {s / d:.2f}", flush=True)
    lines = ["# Sparse vs dense decode step by context (choosing `sparse_min_ratio`)", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, {args.threads} ORT threads; onnxruntime "
             f"{ort.__version__}. Model: `{package.path.name}` ({package.num_layers} layers, page "
             f"{package.page_size}, sub-page {package.sub_page_size}, {package.dtype}).",
             f"Command: `python benchmarks/sparse_threshold.py --model {args.model} --contexts {args.contexts} "
             f"--batches {args.batches} --budget {args.budget} --steps {args.steps} --threads {args.threads}`.",
             "", "One ORT session over `model.ort.onnx`, random page pool, sparse (budget "
             f"{args.budget}) and dense (budget 0) steps interleaved; medians of {args.steps}. "
             "sparse / dense < 1: selecting pays.", ""] + ([args.note, ""] if args.note else []) + [
             "| context | context / budget | batch | sparse ms | dense ms | sparse / dense |",
             "|---|---|---|---|---|---|"]
    for context, batch, s, d in rows:
        lines.append(f"| {context} | {context / args.budget:.2f} | {batch} | {s * 1e3:.1f} | {d * 1e3:.1f} | "
                     f"{s / d:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
