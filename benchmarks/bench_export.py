"""Export wall time, peak RSS and package size against the weights, per source (issue #30).

    python benchmarks/bench_export.py --source NAME=PATH [--source NAME=PATH ...] [--workdir DIR]

Each source (an ONNX export, a .gguf file or an HF folder) is exported by ``tinyserve-export``
in its own process, alone, one after the other; its summary's figures (peak RSS of the export
process, weights, package size, validation) go in one table, benchmarks/results/export.md
(rewritten by each run). The issue's bounds: peak RSS <= 2.5x the weights, package <= 1.1x.
"""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def field(summary: str, name: str) -> str:
    m = re.search(rf"^{re.escape(name)}\s+(.*)$", summary, re.M)
    return m.group(1).strip() if m else "?"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", action="append", required=True, help="NAME=PATH")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_export"))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/export.md")
    args = ap.parse_args()
    rows, ok = [], True
    for item in args.source:
        name, path = item.split("=", 1)
        out = args.workdir / name
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "tinyserve_trt.export.cli", path, "-o", str(out), "--force"],
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            ok = False
            rows.append((name, Path(path).name, f"FAILED (exit {done.returncode}): {done.stderr.strip().splitlines()[-1]}",
                         "", "", "", f"{wall:.0f}"))
            continue
        s = done.stdout
        rows.append((name, Path(path).name, field(s, "peak memory"), field(s, "package size"),
                     field(s, "validation max |logit diff|"), field(s, "time"), f"{wall:.0f}"))
    lines = ["# tinyserve-export: memory, size and time per source", "",
             "Command: `python benchmarks/bench_export.py " + " ".join(f"--source {s}" for s in args.source) + "`",
             f"Machine: {platform.machine()}, {platform.system()}, 2 cores; each export alone in its own process.",
             "Bounds (issue #30): peak RSS <= 2.5x the weights; package <= 1.1x the weights.", "",
             "| source | file | peak memory (export process) | package size | validation | export phases | wall s |",
             "|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
