"""Collect every benchmark result in benchmarks/results/ into REPORT.md with PNG plots.

Reads the machine-readable JSON each benchmark writes next to its markdown
(format: ``tinyserve_dev/evaluation/results.py``); for op_cpu it falls back
to the markdown table when no op_cpu.json exists yet. Benchmarks not run yet
are listed as missing. ``benchmarks/results/analysis.md``, if present, is
appended verbatim (the why behind missed targets, written by a person).

    python benchmarks/report.py [--results DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# (stem, what it measures, which script writes it)
EXPECTED = [
    ("op_cpu", "one decode step of the op in ONNX Runtime CPU vs dense attention", "benchmarks/bench_op.py"),
    ("quality", "perplexity vs budget per policy, attention-mass recall (SmolLM2)", "benchmarks/quality.py"),
    ("passkey", "passkey retrieval accuracy per context and budget (SmolLM2)", "benchmarks/passkey.py"),
    ("decode_cpu", "end-to-end decode tokens/s vs context per system, CPU", "decode benchmark"),
    ("prefix_cpu", "prefix-cache sharing: KV pages and TTFT (SmolLM2)", "benchmarks/bench_prefix.py"),
    ("mixed_precision", "INT8 cold pages: KV bytes vs top-1 agreement", "benchmarks/bench_mixed.py"),
    ("serve_cpu", "serving throughput and latency, CPU", "benchmarks/bench_serve.py"),
    ("gpu_h200", "CUDA kernels / TensorRT on an H200", "benchmarks/gpu_check.py"),
    ("quality_sweep", ("selection variants at budget 1024 (page size, GQA reduce, sinks, recent, dense layers, "
                       "two-level), one section per run"), "benchmarks/quality_sweep.py"),
    ("page_size_cpu", "decode step time vs page size (page 16, two-level 32 -> 4)", "benchmarks/bench_page_size.py"),
    ("decode_profile", "one decode step under ORT's profiler, per node kind", "benchmarks/profile_decode.py"),
    ("native_op_cpu", "the native CPU decode kernel vs the op's function", "benchmarks/bench_native_op.py"),
    ("cold_decode_cpu", "decode steps reading cold (INT8 / INT4) pages", "benchmarks/bench_cold_decode.py"),
    ("sparse_threshold", "where sparse decode starts paying for itself", "benchmarks/sparse_threshold.py"),
    ("scale_cpu", "Ray Serve replicas: throughput and prefix-routed TTFT", "benchmarks/bench_scale.py"),
]


def load(results: Path, stem: str) -> dict | None:
    path = results / f"{stem}.json"
    if path.is_file():
        return json.loads(path.read_text())
    if stem == "op_cpu" and (results / "op_cpu.md").is_file():
        return op_from_markdown((results / "op_cpu.md").read_text())
    return None


def op_from_markdown(text: str) -> dict | None:
    """op_cpu.md as written before bench_op.py wrote JSON: its table and header line."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].isdigit():
            rows.append(dict(context=int(cells[0]), sparse_ms=float(cells[1]), dense_op_ms=float(cells[2]),
                             export_ms=float(cells[3])))
    machine = re.search(r"Machine: (.*?)\. Command: `([^`]*)`", text)
    if not rows:
        return None
    return dict(benchmark="op", rows=rows, machine=machine.group(1) if machine else "?",
                command=machine.group(2) if machine else "python benchmarks/bench_op.py",
                source="op_cpu.md (no JSON yet)")


def decode_records(results: Path) -> dict[str, dict]:
    """Every results JSON in the decode-throughput format, by stem."""
    found = {}
    for path in sorted(results.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        rows = record.get("rows") if isinstance(record, dict) else None
        if isinstance(rows, list) and rows and all("tokens_per_s" in r and "context" in r for r in rows):
            found[path.stem] = record
    return found


# ---- plots -----------------------------------------------------------------------------------------

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_op(op: dict, out: Path) -> Path:
    plt = _plt()
    ctx = [r["context"] for r in op["rows"]]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.plot(ctx, [r["export_ms"] / r["sparse_ms"] for r in op["rows"]], "o-", label="vs export's attention (b)")
    ax.plot(ctx, [r["dense_op_ms"] / r["sparse_ms"] for r in op["rows"]], "s-", label="vs op, dense budget (a)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("speedup of the sparse step")
    ax.set_title("Op decode step, ONNX Runtime CPU")
    ax.legend()
    return _save(fig, out)


def plot_ppl(q: dict, out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    runs = [r for r in q["runs"] if r["policy"] != "dense" and r["dense_layers"] == q["dense_layers"]]
    for policy in dict.fromkeys(r["policy"] for r in runs):
        pts = sorted((r["budget"], r["ratio"]) for r in runs if r["policy"] == policy)
        ax.plot(*zip(*pts), "o-", label=policy)
    ax.axhline(1.0, color="grey", lw=0.8, label="dense")
    ax.axhline(q["targets"]["ppl_ratio_1k"], color="red", ls="--", lw=0.8, label="target at 1024")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token budget")
    ax.set_ylabel("perplexity / dense")
    ax.set_title(f"SmolLM2, {q['context']} tokens, first {q['dense_layers']} layers dense")
    ax.legend()
    return _save(fig, out)


def plot_recall(q: dict, out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for policy, per_f in q["recall"].items():
        pts = sorted((float(f), v["mean"]) for f, v in per_f.items())
        ax.plot([100 * f for f, _ in pts], [r for _, r in pts], "o-", label=policy)
    ax.axhline(q["targets"]["recall_30pct"], color="red", ls="--", lw=0.8, label="target at 30%")
    ax.set_xlabel("pages kept (%)")
    ax.set_ylabel("attention-mass recall")
    ax.set_title("Recall, mean over all layers, heads, steps")
    ax.legend()
    return _save(fig, out)


def plot_passkey(p: dict, out: Path) -> Path:
    plt = _plt()
    names = ["dense"] + [str(b) for b in p["budgets"]]
    contexts = list(p["accuracy"])
    grid = [[p["accuracy"][c][n] for n in names] for c in contexts]
    fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(names), 1.0 + 0.55 * len(contexts)))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(names)), ["dense" if n == "dense" else f"b{n}" for n in names])
    ax.set_yticks(range(len(contexts)), contexts)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("token budget")
    ax.set_ylabel("context (tokens)")
    ax.set_title("Passkey accuracy")
    fig.colorbar(im, ax=ax)
    return _save(fig, out)


def plot_decode(records: dict[str, dict], out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for stem, record in records.items():
        series: dict[str, list] = {}
        for r in record["rows"]:
            series.setdefault(f"{stem}: {r['system']} (batch {r.get('batch', 1)})", []).append(
                (r["context"], r["tokens_per_s"]))
        for label, pts in series.items():
            ax.plot(*zip(*sorted(pts)), "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("tokens/s")
    ax.set_title("Decode throughput")
    ax.legend(fontsize=7)
    return _save(fig, out)


def _save(fig, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    _plt().close(fig)
    return out


# ---- markdown ----------------------------------------------------------------------------------------

def provenance(record: dict) -> str:
    note = " **Incomplete run** (stopped before its grid finished; the cells present are measured)." \
        if record.get("complete") is False else ""
    return f"Machine: {record.get('machine', '?')}. Command: `{record.get('command', '?')}`.{note}"


def section_op(op: dict, results: Path) -> list[str]:
    lines = [provenance(op) + (f" Source: {op['source']}." if op.get("source") else ""), "",
             "| context | sparse (ms) | op dense (ms) | export attention (ms) | speedup vs export | vs op dense |",
             "|---|---|---|---|---|---|"]
    for r in op["rows"]:
        lines.append(f"| {r['context']} | {r['sparse_ms']:.3f} | {r['dense_op_ms']:.3f} | {r['export_ms']:.3f} | "
                     f"{r['export_ms'] / r['sparse_ms']:.2f}x | {r['dense_op_ms'] / r['sparse_ms']:.2f}x |")
    plot_op(op, results / "op_speedup.png")
    return lines + ["", "![op speedup](op_speedup.png)", "", "Details: [op_cpu.md](op_cpu.md)."]


def section_quality(q: dict, results: Path) -> list[str]:
    h = q["headline"]
    t = q["targets"]
    lines = [provenance(q), "",
             f"Text `{q['text']}`: {q['prefill_tokens']} tokens prefilled densely, {q['eval_tokens']} decode steps "
             f"scored; page {q['page_size']}, first {q['dense_layers']} layers dense. Dense perplexity "
             f"{q['dense_ppl']:.4f}. Run time {q['wall_seconds']:.0f} s.", ""]
    runs = [r for r in q["runs"] if r["policy"] != "dense" and r["dense_layers"] == q["dense_layers"]]
    budgets = sorted({r["budget"] for r in runs})
    lines += ["| policy (ppl / dense) | " + " | ".join(str(b) for b in budgets) + " |",
              "|---" * (len(budgets) + 1) + "|"]
    for policy in dict.fromkeys(r["policy"] for r in runs):
        cells = {r["budget"]: f"{r['ratio']:.4f}" for r in runs if r["policy"] == policy}
        lines.append(f"| {policy} | " + " | ".join(cells.get(b, "-") for b in budgets) + " |")
    fracs = list(next(iter(q["recall"].values())))
    lines += ["", "| policy (recall) | " + " | ".join(f"{float(f):.0%}" for f in fracs) + " |",
              "|---" * (len(fracs) + 1) + "|"]
    for policy, per_f in q["recall"].items():
        lines.append(f"| {policy} | " + " | ".join(f"{per_f[f]['mean']:.4f}" for f in fracs) + " |")
    dl_runs = [r for r in q["runs"] if r["policy"] == "query_aware" and r["dense_layers"] != q["dense_layers"]]
    if dl_runs:
        lines += ["", "Dense leading layers (query_aware, ppl / dense):", "",
                  "| budget | dense_layers | ratio | with the default |", "|---|---|---|---|"]
        for r in dl_runs:
            base = next((x for x in q["runs"] if x["policy"] == "query_aware" and x["budget"] == r["budget"]
                         and x["dense_layers"] == q["dense_layers"]), None)
            default = f"{base['ratio']:.4f} (dense_layers={q['dense_layers']})" if base else "-"
            lines.append(f"| {r['budget']} | {r['dense_layers']} | {r['ratio']:.4f} | {default} |")
    plot_ppl(q, results / "quality_ppl.png")
    plot_recall(q, results / "quality_recall.png")
    lines += ["", "![perplexity vs budget](quality_ppl.png) ![recall vs pages](quality_recall.png)", "",
              "Targets:", "",
              f"- ppl within 2% of dense at budget 1024: {h['ppl_ratio_1k']:.4f} -> "
              + _verdict(h["ppl_ratio_1k"] <= t["ppl_ratio_1k"], f"{100 * (h['ppl_ratio_1k'] - t['ppl_ratio_1k']):.2f} points"),
              f"- recall >= 0.95 at 30% of pages: {h['recall_30pct']:.4f} -> "
              + _verdict(h["recall_30pct"] >= t["recall_30pct"], f"{t['recall_30pct'] - h['recall_30pct']:.4f}"),
              "", "Details: [quality.md](quality.md)."]
    return lines


def section_passkey(p: dict, results: Path) -> list[str]:
    names = ["dense"] + [str(b) for b in p["budgets"]]
    lines = [provenance(p), "", f"{len(p['depths'])} depths per context; policy {p['policy']}, "
             f"first {p['dense_layers']} layers dense. Run time {p['wall_seconds']:.0f} s.", "",
             "| context | " + " | ".join("dense" if n == "dense" else f"b{n}" for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for c, acc in p["accuracy"].items():
        lines.append(f"| {c} | " + " | ".join(f"{acc[n]:.2f}" for n in names) + " |")
    h = p["headline"]
    plot_passkey(p, results / "passkey_heatmap.png")
    return lines + ["", "![passkey accuracy](passkey_heatmap.png)", "",
                    f"Target: accuracy at budget 512 = dense: {h['passkey_acc_b512']:.2f} vs "
                    f"{h['passkey_acc_dense']:.2f} -> "
                    + _verdict(h["passkey_acc_b512"] >= h["passkey_acc_dense"],
                               f"{h['passkey_acc_dense'] - h['passkey_acc_b512']:.2f}"),
                    "", "Details: [passkey.md](passkey.md)."]


def section_decode(records: dict[str, dict], results: Path) -> list[str]:
    lines = []
    for stem, record in records.items():
        lines += [f"`{stem}.json`: {provenance(record)}", "", "| system | batch | context | tokens/s |",
                  "|---|---|---|---|"]
        lines += [f"| {r['system']} | {r.get('batch', 1)} | {r['context']} | {r['tokens_per_s']:.1f} |"
                  for r in record["rows"]]
        lines.append("")
    plot_decode(records, results / "decode_tokens.png")
    return lines + ["![tokens/s vs context](decode_tokens.png)"]


def _verdict(met: bool, gap: str) -> str:
    return "**met**" if met else f"**missed** by {gap}"


def build(results: Path) -> str:
    lines = ["# tinyserve-trt benchmark report", "",
             "Generated by `python benchmarks/report.py` from the JSON in this folder; each section names the "
             "machine and the command that produced it.", "", "| benchmark | what | state |", "|---|---|---|"]
    loaded = {stem: load(results, stem) for stem, _, _ in EXPECTED}
    decode = decode_records(results)
    for stem, what, script in EXPECTED:
        present = loaded[stem] is not None or (results / f"{stem}.md").is_file()
        state = "present" if present else f"**missing** (run {script})"
        lines.append(f"| {stem} | {what} | {state} |")
    sections = [("Op speed (op_cpu)", "op_cpu", section_op), ("Perplexity and recall (quality)", "quality",
                section_quality), ("Passkey retrieval (passkey)", "passkey", section_passkey)]
    for title, stem, fn in sections:
        lines += ["", f"## {title}", ""]
        lines += fn(loaded[stem], results) if loaded[stem] else [f"Missing: no {stem}.json in this folder."]
    lines += ["", "## Decode throughput", ""]
    lines += section_decode(decode, results) if decode else [
        "Missing: no decode results yet. A decode benchmark writes `<name>.json` in the format documented in "
        "`tinyserve_dev/evaluation/results.py` (rows of system, context, batch, tokens_per_s)."]
    others = [stem for stem, _, _ in EXPECTED[3:] if stem not in decode and (loaded[stem] or
                                                                             (results / f"{stem}.md").is_file())]
    if others:
        lines += ["", "## Other results", ""] + [f"- [{s}.md]({s}.md)" for s in others]
    analysis = results / "analysis.md"
    if analysis.is_file():
        lines += ["", analysis.read_text().strip()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    text = build(args.results)
    (args.results / "REPORT.md").write_text(text)
    print(f"wrote {args.results / 'REPORT.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
