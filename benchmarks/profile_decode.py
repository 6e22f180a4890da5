"""Where one decode step's time goes: ORT's profiler over our package and ORT GenAI's graph.

Both graphs run in plain ONNX Runtime sessions in this one process, side by side,
on synthetic inputs of the same shape: ``--batch`` sequences of ``--context``
cached tokens, one new token each. Ours is the package's ORT-optimized graph
(``model.ort.onnx``, what the runtime loads on the CPU EP) fed a random page pool;
GenAI's is its ``model.onnx`` fed random past K/V (no shared past/present buffer).
Each node of ours is labelled by where it came from before profiling:

  body  an inlined node of the op's ONNX function (``ops/function.py``) that reads a
        layer's tensors (its pools, its query / key / value)
  step  an inlined node of the op that reads only per-step inputs (page table, lengths,
        budget, static dims): page counts, masks, the dense switch. Once per step when
        ORT merged it across layers (``export/shared_shapes.py``), else once per layer
  rest  the rest of the model (projections, norms, rotary, MLP, LM head)

Reported per (graph, label, op type): node executions per step, ms per step and
share of the profiled node time; plus the optimized graph's node counts and the
wall time per step measured with the profiler off (interleaved, median). The
profiler adds a little per node, so shares matter more than its totals.
Writes benchmarks/results/decode_profile.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tinyserve_trt.runtime.model_package import ModelPackage  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# values of the op's inlined function (ORT's or onnx's inliner) and the op's own outputs (export/kv_io.py)
BODY = re.compile(r"(_inlfunc_|(^|_)qsa\d+_|^(attention_output|selected_pages)\.\d+$)")


def labels(model) -> list[str]:
    """Each node's label: ``body`` / ``step`` / ``rest`` (see the module doc). A body node is
    ``step`` when it reads only per-step inputs (no layer's pools or activations)."""
    graph = model.graph
    per_step = {t.name for t in graph.initializer} | {""}
    per_step |= {i.name for i in graph.input if not re.search(r"\.\d+$", i.name)}  # not key_cache.3, ...
    out = []
    for node in graph.node:
        shared = all(i in per_step for i in node.input)
        if shared:
            per_step.update(node.output)
        body = any(BODY.search(o) for o in node.output)
        out.append("rest" if not body else "step" if shared else "body")
    return out


def labelled_copy(model_path: Path, tmp: Path) -> Path:
    """``model_path`` with every node named ``<label>#<i>`` (profile events carry node names),
    written into ``tmp`` beside hard links (ORT refuses symlinks out of the model's directory)
    or copies of its external data files."""
    import shutil

    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    for i, (node, label) in enumerate(zip(model.graph.node, labels(model))):
        node.name = f"{label}#{i}"
    for f in model_path.parent.iterdir():
        if f.name.endswith(".data"):
            try:
                os.link(f, tmp / f.name)
            except OSError:
                shutil.copyfile(f, tmp / f.name)
    out = tmp / model_path.name
    onnx.save_model(model, str(out))
    return out


def node_counts(model_path: Path) -> Counter:
    import onnx

    return Counter(labels(onnx.load(str(model_path), load_external_data=False)))


def session(path: Path, threads: int, profile_prefix: str | None = None):
    import onnxruntime as ort

    import onnx

    from tinyserve_trt.export.native_decode import session_options

    # a graph that decodes on the native CPU kernel needs its library (export/native_decode.py)
    graph = onnx.load(str(path), load_external_data=False)
    so = session_options(graph)
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def ours_feeds(package: ModelPackage, context: int, batch: int, budget: int, seed: int = 0) -> dict:
    """One decode step: every row has ``context`` cached tokens on its own pages."""
    rng = np.random.default_rng(seed)
    ps, hkv, d = package.page_size, package.num_kv_heads, package.head_dim
    n_pages = -(-(context + 1) // ps)
    pool = batch * n_pages + 1
    dtype = np.dtype(package.dtype)
    inputs = package.inputs
    feeds = {inputs["input_ids"]: rng.integers(3, package.vocab_size, (batch, 1)).astype(np.int64),
             inputs["page_table"]: (1 + np.arange(batch * n_pages, dtype=np.int32)).reshape(batch, n_pages),
             inputs["past_lens"]: np.full(batch, context, np.int32),
             inputs["token_budget"]: np.full(batch, budget, np.int32)}
    if "position_ids" in inputs:
        feeds[inputs["position_ids"]] = np.full((batch, 1), context, np.int64)
    if "logits_index" in inputs:
        feeds[inputs["logits_index"]] = np.zeros(batch, np.int64)
    for names in package.layers:
        keys = rng.standard_normal((pool, hkv, ps, d)).astype(dtype)
        feeds[names["key_cache"]] = keys
        feeds[names["value_cache"]] = rng.standard_normal((pool, hkv, ps, d)).astype(dtype)
        feeds[names["key_min"]] = keys.min(axis=2)
        feeds[names["key_max"]] = keys.max(axis=2)
        if "key_sub_bounds" in names:
            r = ps // package.sub_page_size  # sub-pages per page
            feeds[names["key_sub_bounds"]] = rng.integers(0, 256, (pool, hkv, r, d)).astype(np.uint8)
    return feeds


def genai_feeds(sess, context: int, batch: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(3, 1000, (batch, 1)).astype(np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((batch, context + 1), np.int64)
        elif i.name.startswith("past_key_values"):
            feeds[i.name] = rng.standard_normal((batch, i.shape[1], context, 64)).astype(np.float32)
        else:
            raise ValueError(f"unexpected GenAI input {i.name!r}")
    return feeds


def profile(path: Path, feeds: dict, steps: int, threads: int, tmp: Path, tag: str) -> tuple[dict, float]:
    """(label, op type) -> (executions, total us) over ``steps`` runs after a warm-up."""
    sess = session(path, threads, str(tmp / tag))
    sess.run(None, feeds)
    for _ in range(steps):
        sess.run(None, feeds)
    events = json.loads(Path(sess.end_profiling()).read_text())
    per_run = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    out: dict = defaultdict(lambda: [0, 0.0])
    first = per_run[1]["ts"] if len(per_run) > 1 else 0  # skip the warm-up run
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time") or e["ts"] < first:
            continue
        label = e["name"].split("#", 1)[0] if "#" in e["name"] else "rest"
        rec = out[(label, e["args"]["op_name"])]
        rec[0] += 1
        rec[1] += e["dur"]
    run_ms = statistics.median(e["dur"] for e in per_run[1:]) / 1e3 if len(per_run) > 1 else float("nan")
    return {k: (n / steps, us / steps / 1e3) for k, (n, us) in out.items()}, run_ms


def wall(sessions: dict, feeds: dict, steps: int) -> dict:
    """Median seconds per run of each session, interleaved step by step. Each timed run follows
    an untimed one of the same session: ORT's pool threads spin a while after a run, and on
    few cores the previous session's spinning would be charged to the next one."""
    times = defaultdict(list)
    for _ in range(steps):
        for name, s in sessions.items():
            s.run(None, feeds[name])
            t0 = time.perf_counter()
            s.run(None, feeds[name])
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def table(title: str, prof: dict, top: int) -> list[str]:
    total = sum(ms for _, ms in prof.values())
    lines = [f"### {title}", "", "| where | op type | nodes run / step | ms / step | share |", "|---|---|---|---|---|"]
    by_label = defaultdict(lambda: [0.0, 0.0])
    for (label, _), (n, ms) in prof.items():
        by_label[label][0] += n
        by_label[label][1] += ms
    for label, (n, ms) in sorted(by_label.items(), key=lambda x: -x[1][1]):
        lines.append(f"| **{label}** | all | {n:.0f} | {ms:.2f} | {ms / total:.0%} |")
    for (label, op), (n, ms) in sorted(prof.items(), key=lambda x: -x[1][1])[:top]:
        lines.append(f"| {label} | {op} | {n:.0f} | {ms:.2f} | {ms / total:.1%} |")
    lines.append(f"| | **total** | {sum(n for n, _ in prof.values()):.0f} | {total:.2f} | 100% |")
    heavy = sum(ms for (_, op), (_, ms) in prof.items() if op in HEAVY)
    small = sum(n for (_, op), (n, _) in prof.items() if op not in HEAVY)
    lines += ["", f"Matrix work ({', '.join(HEAVY)}) {heavy / total:.0%} of the node time; the other "
                  f"{small:.0f} nodes a step (gathers, masks, shapes, norms, elementwise) {1 - heavy / total:.0%}."]
    return lines + [""]


HEAVY = ("MatMul", "FusedMatMul", "GroupQueryAttention", "Gemm")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="tinyserve package (tinyserve-export output)")
    ap.add_argument("--genai-model", type=Path, help="an onnxruntime-genai model dir of the same model")
    ap.add_argument("--before", type=Path, help="an older package of the same model, profiled alongside as 'before'")
    ap.add_argument("--contexts", default="512,8000")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--budget", type=int, default=1024, help="token budget (>= context: the op runs dense)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=15, help="op types listed per graph")
    ap.add_argument("--out", type=Path, default=RESULTS / "decode_profile.md")
    ap.add_argument("--note", default="", help="a line for the table's header (e.g. what else ran)")
    args = ap.parse_args(argv)
    if not (args.model / "tinyserve.json").is_file():
        print(f"error: {args.model} is not a tinyserve package", file=sys.stderr)
        return 2
    if args.genai_model is not None and not (args.genai_model / "model.onnx").is_file():
        print(f"error: {args.genai_model} has no model.onnx", file=sys.stderr)
        return 2
    import onnxruntime as ort

    package = ModelPackage.load(args.model)
    ours_path = package.ort_model_path(ort.__version__)
    counts = node_counts(ours_path)
    lines = ["# One decode step under ORT's profiler: tinyserve vs ORT GenAI", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, {args.threads} ORT threads; onnxruntime "
             f"{ort.__version__}. Model: `{package.path.name}` ({package.num_layers} layers, page {package.page_size},"
             f" {package.dtype}), graph `{ours_path.name}`: {sum(counts.values())} nodes "
             f"({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}).",
             f"Command: `python benchmarks/profile_decode.py --model {args.model}"
             + (f" --genai-model {args.genai_model}" if args.genai_model else "")
             + (f" --before {args.before}" if args.before else "")
             + f" --contexts {args.contexts} --batch {args.batch} --budget {args.budget} --steps {args.steps}`.",
             "", "Both graphs run in plain ORT sessions in one process on synthetic inputs of the same shape "
             "(ours: the package's `model.ort.onnx` over a random page pool; GenAI: its `model.onnx` over random "
             "past K/V, no shared past/present buffer). Labels: **body** = the op's inlined nodes that read a "
             "layer's tensors; **step** = the op's nodes that read only per-step inputs (page counts, masks, the "
             "dense switch); **rest** = the rest of the model. The profiler adds a little per node: read shares "
             "and counts, and the profiler-off wall times for the ratio.", ""] + ([args.note, ""] if args.note else [])
    if args.genai_model is not None:
        import onnx

        g = onnx.load(str(args.genai_model / "model.onnx"), load_external_data=False)
        lines.insert(3, f"GenAI graph `{args.genai_model.name}/model.onnx`: {len(g.graph.node)} nodes before ORT's "
                        "optimizations.")
    with tempfile.TemporaryDirectory(prefix="profile_decode.") as tmp:
        tmp = Path(tmp)
        (tmp / "ours").mkdir()
        labelled = labelled_copy(ours_path, tmp / "ours")
        before = None
        if args.before is not None:
            old = ModelPackage.load(args.before)
            (tmp / "before").mkdir()
            before = labelled_copy(old.ort_model_path(ort.__version__), tmp / "before")
            old_counts = node_counts(old.ort_model_path(ort.__version__))
            lines.insert(3, f"Before: `{args.before}`, {sum(old_counts.values())} nodes ("
                            f"{', '.join(f'{k} {v}' for k, v in sorted(old_counts.items()))}).")
        for context in (int(c) for c in args.contexts.split(",")):
            mode = "dense" if args.budget <= 0 or args.budget >= context else f"sparse, budget {args.budget}"
            feeds = {"ours": ours_feeds(package, context, args.batch, args.budget)}
            paths = {"ours": labelled}
            if before is not None:
                paths["before"], feeds["before"] = before, ours_feeds(old, context, args.batch, args.budget)
            if args.genai_model is not None:
                paths["genai"] = args.genai_model / "model.onnx"
                feeds["genai"] = genai_feeds(session(paths["genai"], args.threads), context, args.batch)
            profs = {k: profile(p, feeds[k], args.steps, args.threads, tmp, f"{k}{context}") for k, p in paths.items()}
            walls = wall({k: session(p, args.threads) for k, p in paths.items()}, feeds, args.steps)
            head = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in walls.items())
            ratio = f"; ours / genai = {walls['ours'] / walls['genai']:.2f}" if "genai" in walls else ""
            lines += [f"## Context {context}, batch {args.batch} (ours {mode})", "",
                      f"Wall time per step, profiler off, interleaved median of {args.steps}: {head}{ratio}.", ""]
            for k, (prof, run_ms) in profs.items():
                lines += table(f"{k} (profiled run {run_ms:.1f} ms)", prof, args.top)
            print(f"context {context}: {head}{ratio}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
