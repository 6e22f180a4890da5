"""What a smaller page costs at decode: the same model exported at several page sizes, side by side.

Packages are told apart by their selection (``label``): ``page 16`` is single level,
``page 32->4`` two-level (32-token pages, 4-token sub-pages), so the two-level
default can be timed against the old single-level page-16 default in one run.

Smaller pages rank better (quality_sweep.md#quality_sweep_pages: ppl at budget 1024 is
1.040 / 1.021 / 1.011 of dense at page 16 / 8 / 4) but each decode step reads
one key_min/key_max pair per page. For each package (``--models``, exported
from the same source with different ``--page-size``) and each (context,
batch), the tinyserve decode step is timed sparse (``--budget``) and dense,
with ``bench_decode.time_tinyserve``; packages alternate within each pass.
Writes benchmarks/results/page_size_cpu.md; the LAST line printed is
``RESULT sparse_step_ratio=<smallest page / largest page at the largest context and batch>``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_decode import RESULTS, prompts, time_tinyserve  # noqa: E402
from tinyserve_trt.runtime.model_package import ModelPackage  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, nargs="+", required=True, help="packages of one model, different page sizes")
    ap.add_argument("--contexts", default="8000")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", type=Path, default=RESULTS / "page_size_cpu.md")
    args = ap.parse_args(argv)
    packages = [ModelPackage.load(m) for m in args.models]
    if len({(p.num_layers, p.num_kv_heads, p.head_dim, p.vocab_size) for p in packages}) != 1:
        ap.error("--models must be exports of one model (same layers, heads, head dim, vocab)")
    packages.sort(key=lambda p: (-p.page_size, p.sub_page_size))
    if len({label(p) for p in packages}) != len(packages):
        ap.error("--models must differ in page size or sub-page size")
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            rows_in = prompts(packages[0].vocab_size, context, batch)
            best: dict[int, dict[str, float]] = {}
            for _ in range(args.passes):
                for p in packages:
                    res = time_tinyserve(p, rows_in, {"sparse": args.budget, "dense": 0}, args.steps, args.threads)
                    cur = best.setdefault(label(p), {})
                    for k, v in res.items():
                        cur[k] = min(cur.get(k, float("inf")), v)
            rows.append((context, batch, best))
            print(f"context {context} batch {batch}: " + " ".join(
                f"{ps}: sparse={b['sparse'] * 1e3:.1f}ms dense={b['dense'] * 1e3:.1f}ms" for ps, b in best.items()),
                flush=True)
    write(args, packages, rows)
    context, batch, best = rows[-1]
    small, large = label(packages[-1]), label(packages[0])
    print(f"RESULT sparse_step_ratio={best[small]['sparse'] / best[large]['sparse']:.2f}")
    return 0


def label(p: ModelPackage) -> str:
    sub = p.sub_page_size
    return f"page {p.page_size}->{sub}" if sub and sub != p.page_size else f"page {p.page_size}"


def write(args, packages, rows) -> None:
    import platform

    import onnxruntime as ort

    sizes = [label(p) for p in packages]
    lines = ["# Decode step vs page size on CPU (tinyserve sparse and dense)", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, {args.threads} ORT threads; onnxruntime "
             f"{ort.__version__}. Packages: " + ", ".join(f"`{p.path.name}` ({label(p)})" for p in packages)
             + f". Budget {args.budget} tokens. Command: `python benchmarks/bench_page_size.py --models "
             + " ".join(str(m) for m in args.models) + f" --contexts {args.contexts} --batches {args.batches}` "
             f"(median of {args.steps} decode steps, best of {args.passes} passes, packages alternating).", "",
             "| context | batch | " + " | ".join(f"{s} sparse ms | {s} dense ms" for s in sizes)
             + f" | sparse {sizes[-1]} / {sizes[0]} |",
             "|---|---|" + "---|---|" * len(sizes) + "---|"]
    for context, batch, best in rows:
        cells = " | ".join(f"{best[s]['sparse'] * 1e3:.1f} | {best[s]['dense'] * 1e3:.1f}" for s in sizes)
        lines.append(f"| {context} | {batch} | {cells} | {best[sizes[-1]]['sparse'] / best[sizes[0]]['sparse']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
