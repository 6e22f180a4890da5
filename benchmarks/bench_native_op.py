"""One layer's decode step: the native CPU node vs the op's ONNX function, in ONNX Runtime CPU.

Same inputs, side by side in one process: --heads (default SmolLM2's H 9, Hkv 3; D 64), --context cached
tokens per sequence, batch sizes --batches, the two-level default (ps 32, sp 4) and single-level
ps 16, token budget --budget, each selecting config once per --group-reduce (max: one selection per
KV head; head: per query head). ``function`` = a single-node model with the op's function body
(ops/node.py make_op_model); ``native`` = tinyserve.cpu::QueryAwareSparseAttentionDecode
(tinyserve_trt/cpu); ``dense`` = the dense policy (the calibrated dense layers). With --baseline-lib,
another build of the library beside them (a kernel change measured against the last one in one run).
Each output checked against the float64 reference (ops/reference.py) before timing (``check``: near-tie
flips noted, a build off on more than 1/8 of the heads fails). Median of --repeats runs, interleaved (the order
turning each repeat); ORT threads do not spin. The calls run warm (the same pages every call stay in
cache) unless --cold-mb N: then before each timed call N MB are streamed through the caches and the same
build runs a small (256-token) case, so the code is warm and the pages come from DRAM - as in a real
step, where the weights stream through the caches between two calls of a layer (session 27: the 8K
two-level node 0.47-0.66 ms cold vs 0.28-0.38 warm). The native pool size is TINYSERVE_NATIVE_THREADS
(read once per process; set it with --native-threads). Appends to
benchmarks/results/native_op_cpu.md; the LAST line printed is
``RESULT worst_native_over_function=<the largest native / function time ratio>``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tinyserve_dev.cases import CaseSpec, make_case  # noqa: E402
from tinyserve_trt.ops import schema  # noqa: E402
from tinyserve_trt.ops.reference import sparse_attention_ref  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = (("two-level ps32/sp4", 32, 4, "query_aware"), ("single-level ps16", 16, 0, "query_aware"),
           ("dense ps32", 32, 0, "dense"))  # dense: the calibrated dense layers, every cached token


def check(case: str, outputs: dict, ref: np.ndarray, notes: list[str]) -> None:
    """Each output [B, H, 1, D] against the float64 reference: float32 scores may order a near-tie at
    the budget's edge otherwise (thousands of candidates, random keys), and that query head then
    attends another sub-page - noted; a build off on more than 1/8 of the (sequence, head) rows is
    wrong, not rounded (an AssertionError)."""
    tol = schema.TOLERANCES["float32"]
    for name, out in outputs.items():
        bad = ~np.isclose(out, ref, **tol).reshape(out.shape[0] * out.shape[1], -1).all(axis=1)
        if bad.sum() * 8 > bad.size:
            raise AssertionError(f"{case}: {name} is off the reference on {bad.sum()} of {bad.size} heads")
        if bad.any():
            notes.append(f"- {case}: {name} is {float(np.abs(out - ref).max()):.1e} off the float64 reference on "
                         f"{bad.sum()} of {bad.size} query heads (a near-tie at the budget's edge ordered "
                         f"otherwise in float32)")


def session(model, threads: int, native_lib: bool | str):
    import onnxruntime as ort

    from tinyserve_trt.cpu import native

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    # Two sessions alternate: an idle one's spinning threads would steal the other's cores
    # (measured: the native node 8.9 -> 4.8 ms, the function 16 -> 8.5 ms at batch 8 on 2 cores).
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if isinstance(native_lib, str):  # another build of the library (--baseline-lib)
        so.register_custom_ops_library(native_lib)
    elif native_lib:
        native.register(so)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def interleaved_medians(fns: dict, warmup: int, repeats: int, before: dict | None = None) -> dict[str, float]:
    """Median ms of each callable, interleaved; the order turns each repeat (a call right after
    another that read the same pages would find them in cache). ``before[k]``, if given, runs
    (untimed) right before each timed call of ``fns[k]``."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in fns}
    keys = list(fns)
    for r in range(repeats):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            if before:
                before[k]()
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def cold_calls(fns: dict, args, case_args: dict, rng) -> dict | None:
    """With --cold-mb: per timed callable, what runs before each of its calls - the caches flushed by
    streaming --cold-mb MB, then the same session on a 256-token case of the same shape (its code and
    ORT's warm again, the timed call's pages still cold). None without --cold-mb."""
    if not args.cold_mb:
        return None
    from tinyserve_trt.cpu.node import input_names

    H, Hkv = case_args["heads"]
    attrs = case_args["attrs"]
    small = make_case(CaseSpec((256,) * case_args["batch"], H, Hkv, 64, case_args["ps"], budget=case_args["budget"],
                               sub_page_size=case_args["sp"]), rng)
    names = {"function": schema.node_input_names(two_level=attrs.two_level)}
    flush = np.ones(args.cold_mb << 18, np.float32)  # MB of float32
    before = {}
    for k in fns:
        sess = case_args["sessions"][k]
        feeds = {n: np.array(small[n]) for n in names.get(k, input_names(attrs.two_level)) if n}
        before[k] = lambda sess=sess, feeds=feeds: (flush.max(), sess.run(None, feeds))
    return before


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("H", "HKV"), help="query and KV heads")
    ap.add_argument("--group-reduce", nargs="+", default=["max"], choices=schema.GROUP_REDUCTIONS)
    ap.add_argument("--candidate-share", type=float, default=schema.attribute("candidate_share").default)
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="ORT intra-op threads")
    ap.add_argument("--native-threads", type=int, default=None, help="sets TINYSERVE_NATIVE_THREADS")
    ap.add_argument("--baseline-lib", type=Path, default=None,
                    help="another build of libtinyserve_cpu.so (e.g. the last commit's, from the native cache) "
                         "timed in the same run: the table adds its ms and native / baseline")
    ap.add_argument("--cold-mb", type=int, default=0,
                    help="stream this many MB through the caches, then run a small case, before each timed call "
                         "(pages cold, code warm; 0: warm calls)")
    ap.add_argument("--out", type=Path, default=RESULTS / "native_op_cpu.md")
    args = ap.parse_args(argv)
    if args.cold_mb < 0:
        ap.error(f"--cold-mb must be >= 0, got {args.cold_mb}")
    if args.native_threads is not None:
        os.environ["TINYSERVE_NATIVE_THREADS"] = str(args.native_threads)
    import onnxruntime as ort

    from tinyserve_trt.cpu.native import available
    from tinyserve_trt.cpu.node import input_names, make_decode_model
    from tinyserve_trt.ops.node import make_op_model

    reason = available()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    H, Hkv = args.heads
    lines = [f"\n## context {args.context}, budget {args.budget}, heads {H}/{Hkv}, candidate share "
             f"{args.candidate_share}, ORT {args.threads} threads, native pool "
             f"{os.environ.get('TINYSERVE_NATIVE_THREADS', '1')} thread(s)\n",
             f"{platform.machine()}, {os.cpu_count()} cores, onnxruntime {ort.__version__}; ms per call, "
             f"median of {args.repeats}, interleaved, no spinning"
             + (f"; pages cold ({args.cold_mb} MB streamed and a 256-token call before each call).\n"
                if args.cold_mb else ", warm.\n"),
             "| config | batch | function ms | native ms | native / function |"
             + (" baseline native ms | native / baseline |" if args.baseline_lib else ""),
             "|---|---|---|---|---|" + ("---|---|" if args.baseline_lib else "")]
    if args.baseline_lib:
        lines.insert(2, f"baseline: {args.baseline_lib}\n")
    ratios, notes = [], []
    runs = [(label if policy == "dense" else f"{label}, {gr}", ps, sp, policy, gr)
            for label, ps, sp, policy in CONFIGS
            for gr in (args.group_reduce[:1] if policy == "dense" else args.group_reduce)]
    for label, ps, sp, policy, group_reduce in runs:
        attrs = schema.OpAttributes(sub_page_size=sp, policy=policy, group_reduce=group_reduce,
                                    candidate_share=args.candidate_share)
        fn = session(make_op_model("float32", attrs, head_dim=64, with_selected=False), args.threads, False)
        nat = session(make_decode_model(attrs, with_selected=False), args.threads, True)
        base = session(make_decode_model(attrs, with_selected=False), args.threads, str(args.baseline_lib)) \
            if args.baseline_lib else None
        for batch in args.batches:
            case_args = dict(heads=(H, Hkv), ps=ps, sp=sp, batch=batch, budget=args.budget, attrs=attrs,
                             sessions={"function": fn, "native": nat, "baseline": base})
            case = make_case(CaseSpec((args.context,) * batch, H, Hkv, 64, ps, budget=args.budget, sub_page_size=sp),
                             rng)
            f_feeds = {n: case[n] for n in schema.node_input_names(two_level=attrs.two_level) if n}
            n_feeds = {n: case[n] for n in input_names(attrs.two_level) if n}  # "": a skipped optional input
            f_out, n_out = fn.run(None, f_feeds)[0], nat.run(None, n_feeds)[0]
            ref = sparse_attention_ref(**case, attrs=attrs)[0]  # float64: the judge of every build
            check(f"{label} batch {batch}", {"function": f_out, "native": n_out}, ref, notes)
            fns = {"function": lambda: fn.run(None, f_feeds), "native": lambda: nat.run(None, n_feeds)}
            if base is not None:  # its own copy of the pages: none read warm from the other build's call
                b_feeds = {n: np.array(v) for n, v in n_feeds.items()}
                check(f"{label} batch {batch}", {"baseline": base.run(None, b_feeds)[0]}, ref, notes)
                fns["baseline"] = lambda: base.run(None, b_feeds)
            ms = interleaved_medians(fns, args.warmup, args.repeats, cold_calls(fns, args, case_args, rng))
            row = (f"| {label} | {batch} | {ms['function']:.3f} | {ms['native']:.3f} | "
                   f"{ms['native'] / ms['function']:.3f} |")
            if base is not None:
                row += f" {ms['baseline']:.3f} | {ms['native'] / ms['baseline']:.3f} |"
            print(row, flush=True)
            lines.append(row)
            ratios.append(ms["native"] / ms["function"])
    if notes:
        lines += [""] + notes
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"RESULT worst_native_over_function={max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
