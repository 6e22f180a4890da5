"""One decode step of QueryAwareSparseAttention in ONNX Runtime CPU vs dense attention.

Compared on the same cache, side by side in one run:
  sparse  - the op, query-aware policy, token budget --budget
  (a)     - the same op with a dense budget (0)
  (b)     - what a user's export runs: Concat(past, new) -> GQA repeat
            (Unsqueeze/Expand/Reshape) -> MatMul -> Softmax -> MatMul
Writes benchmarks/results/op_cpu.md; the LAST line printed is
``RESULT speedup_32k=<sparse vs (b) at 32K>``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tinyserve_trt.ops import schema  # noqa: E402
from tinyserve_dev.cases import CaseSpec, make_case  # noqa: E402
from tinyserve_trt.ops.node import make_op_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def plain_export_attention(H: int, Hkv: int, D: int) -> onnx.ModelProto:
    """The attention core of a legacy/optimum export at decode, with its own cache."""
    G = H // Hkv
    b = helper
    nodes = [
        b.make_node("Concat", ["past_key", "key"], ["present_key"], axis=2),
        b.make_node("Concat", ["past_value", "value"], ["present_value"], axis=2),
        b.make_node("Constant", [], ["ax2"], value=helper.make_tensor("ax2", TensorProto.INT64, [1], [2])),
        b.make_node("Shape", ["present_key"], ["kshape"]),
        b.make_node("Constant", [], ["g"], value=helper.make_tensor("g", TensorProto.INT64, [1], [G])),
        b.make_node("Slice", ["kshape", "zero", "two"], ["bh"]),
        b.make_node("Slice", ["kshape", "two", "four"], ["td"]),
        b.make_node("Constant", [], ["zero"], value=helper.make_tensor("zero", TensorProto.INT64, [1], [0])),
        b.make_node("Constant", [], ["two"], value=helper.make_tensor("two", TensorProto.INT64, [1], [2])),
        b.make_node("Constant", [], ["four"], value=helper.make_tensor("four", TensorProto.INT64, [1], [4])),
        b.make_node("Concat", ["bh", "g", "td"], ["exp_shape"], axis=0),
        b.make_node("Constant", [], ["rep_shape"],
                    value=helper.make_tensor("rep_shape", TensorProto.INT64, [4], [0, H, -1, D])),
    ]
    for kv in ("key", "value"):
        nodes += [
            b.make_node("Unsqueeze", [f"present_{kv}", "ax2"], [f"{kv}_u"]),
            b.make_node("Expand", [f"{kv}_u", "exp_shape"], [f"{kv}_e"]),
            b.make_node("Reshape", [f"{kv}_e", "rep_shape"], [f"{kv}_rep"]),
        ]
    nodes += [
        b.make_node("Transpose", ["key_rep"], ["key_t"], perm=[0, 1, 3, 2]),
        b.make_node("MatMul", ["query", "key_t"], ["qk"]),
        b.make_node("Constant", [], ["scale"], value=helper.make_tensor("scale", TensorProto.FLOAT, [], [D ** -0.5])),
        b.make_node("Mul", ["qk", "scale"], ["logits"]),
        b.make_node("Softmax", ["logits"], ["probs"], axis=-1),
        b.make_node("MatMul", ["probs", "value_rep"], ["output"]),
    ]
    # order nodes so constants come first (topological)
    nodes.sort(key=lambda n: n.op_type != "Constant")
    f = TensorProto.FLOAT
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes, "plain_attention",
        [vi("query", f, ["B", H, 1, D]), vi("key", f, ["B", Hkv, 1, D]), vi("value", f, ["B", Hkv, 1, D]),
         vi("past_key", f, ["B", Hkv, "P", D]), vi("past_value", f, ["B", Hkv, "P", D])],
        [vi("output", f, ["B", H, 1, D]), vi("present_key", f, ["B", Hkv, "T", D]),
         vi("present_value", f, ["B", Hkv, "T", D])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def time_runs(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", type=Path, default=RESULTS / "op_cpu.md")
    args = ap.parse_args(argv)

    H, Hkv, D, ps = args.heads, args.kv_heads, args.head_dim, args.page_size
    rng = np.random.default_rng(0)
    op = session(make_op_model("float32", schema.OpAttributes(), head_dim=D, with_selected=False), args.threads)
    plain = session(plain_export_attention(H, Hkv, D), args.threads)
    rows = []
    for ctx in args.contexts:
        case = make_case(CaseSpec((ctx,) * args.batch, H, Hkv, D, ps, 1, "float32", args.budget,
                                  spare_pages=0, extra_table_cols=0), rng)
        feeds = {n: case[n] for n in schema.INPUT_NAMES[: schema.NUM_REQUIRED_INPUTS]}
        dense_feeds = dict(feeds, token_budget=np.zeros_like(case["token_budget"]))
        pk = np.stack([np.concatenate(list(case["key_cache"][case["page_table"][b]]), axis=1)
                       for b in range(args.batch)])  # [B, Hkv, ctx, D] contiguous, as an export's past
        pv = np.stack([np.concatenate(list(case["value_cache"][case["page_table"][b]]), axis=1)
                       for b in range(args.batch)])
        plain_feeds = dict(query=case["query"], key=case["key"], value=case["value"], past_key=pk, past_value=pv)
        # same numbers from all three at a dense budget: a timing of wrong code is worthless
        np.testing.assert_allclose(op.run(None, dense_feeds)[0], plain.run(None, plain_feeds)[0],
                                   atol=1e-4, rtol=1e-4)
        t_sparse = time_runs(lambda: op.run(None, feeds), args.warmup, args.repeats)
        t_dense_op = time_runs(lambda: op.run(None, dense_feeds), args.warmup, args.repeats)
        t_plain = time_runs(lambda: plain.run(None, plain_feeds), args.warmup, args.repeats)
        kv_bytes = 2 * args.batch * Hkv * ctx * D * 4
        sel_bytes = 2 * args.batch * Hkv * min(args.budget, ctx) * D * 4 + 2 * args.batch * Hkv * (ctx // ps) * D * 4
        rows.append(dict(ctx=ctx, sparse=t_sparse, dense_op=t_dense_op, plain=t_plain,
                         bytes_ratio=kv_bytes / sel_bytes))
        print(f"ctx={ctx:6d} sparse={t_sparse*1e3:8.3f} ms  dense-op={t_dense_op*1e3:8.3f} ms  "
              f"plain={t_plain*1e3:8.3f} ms  speedup vs plain={t_plain/t_sparse:5.2f}x  "
              f"vs dense-op={t_dense_op/t_sparse:5.2f}x", flush=True)

    write_table(args, rows)
    at32 = [r for r in rows if r["ctx"] == 32768]
    ref = at32[0] if at32 else rows[-1]
    print(f"RESULT speedup_32k={ref['plain'] / ref['sparse']:.2f}")
    return 0


def write_table(args, rows) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "# QueryAwareSparseAttention decode step, ONNX Runtime CPU",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {args.threads} ORT threads; "
        f"onnxruntime {ort.__version__}. Command: `python benchmarks/bench_op.py` "
        f"(batch {args.batch}, {args.heads} query heads / {args.kv_heads} KV heads, head_dim {args.head_dim}, "
        f"page {args.page_size}, budget {args.budget} tokens, fp32, median of {args.repeats} runs after "
        f"{args.warmup} warm-up runs).",
        "",
        "| context | sparse (ms) | (a) op, dense budget (ms) | (b) export's MatMul-Softmax-MatMul (ms) "
        "| speedup vs (b) | speedup vs (a) | bytes-moved limit |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['ctx']} | {r['sparse']*1e3:.3f} | {r['dense_op']*1e3:.3f} | {r['plain']*1e3:.3f} "
                     f"| {r['plain']/r['sparse']:.2f}x | {r['dense_op']/r['sparse']:.2f}x "
                     f"| {r['bytes_ratio']:.1f}x |")
    lines += ["", NOTES]
    args.out.write_text("\n".join(lines) + "\n")
    # the numbers again, machine-readable, for benchmarks/report.py
    record = dict(benchmark="op", machine=f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} ORT threads, "
                  f"onnxruntime {ort.__version__}", command="python " + " ".join(sys.argv),
                  batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                  page_size=args.page_size, budget=args.budget,
                  rows=[dict(context=r["ctx"], sparse_ms=r["sparse"] * 1e3, dense_op_ms=r["dense_op"] * 1e3,
                             export_ms=r["plain"] * 1e3, bytes_ratio=r["bytes_ratio"]) for r in rows])
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")


NOTES = """## Reading the table

The bytes-moved limit is the dense K+V bytes over what the sparse step reads:
the selected pages' K+V (budget tokens) plus the min/max metadata of every
page (2 x D values per page, 1/8 of the keys at page 16). At 32K with a 2048
budget that is 8x. At 2K the budget covers the whole context, so the step is
dense and all columns should match.

- Against (a), the same op with a dense budget, the sparse step gets close
  to that limit but not to it: scoring (two [G, D] x [D, NP] MatMuls, TopK)
  and ~100 small kernels of a function body have a fixed cost, and ORT's
  Gather materialises the selected pages ([B, Hkv, K*ps, D]) before the
  MatMul, so selected bytes are moved twice.
- Against (b), what a user's export runs, the ratio can pass 8x because (b)
  moves far more than the cache once: Concat(past, new) writes a fresh
  `present` (read + write the whole cache) and the GQA repeat (Unsqueeze /
  Expand / Reshape) copies K and V G times before the MatMuls.
- This VM's speed swings up to 1.8x between runs; only the ratios, measured
  side by side in one run, are meaningful.
"""


if __name__ == "__main__":
    sys.exit(main())
