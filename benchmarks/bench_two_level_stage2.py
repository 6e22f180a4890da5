"""Microbenchmark of the two-level op's level-2 fine score alone (ORT CPU): forms side by side.

From the pools (codes ``[P, Hkv, r, D]`` uint8, ``key_min/key_max [P, Hkv, D]``), the candidates
``phys [B, Hkv, K1]``, the grouped queries ``[B, Hkv, G*S, D]`` and the per-head coarse scores
``[B, Hkv, G*S, K1]`` to the group-max score of every candidate sub-page: gathers, decode,
contraction, reduce. ``body`` is the package's own ``sub_page_score_onnx`` at the given opset (17:
the legacy exporter's; the ``21`` rows use blocked DequantizeLinear); the others are alternatives.
Each is checked against the float64 decode (``ops/fine_bounds.py``) and all are timed interleaved
(round robin, median per form) in one process, as the machine is shared. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as T, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tinyserve_trt.ops import fine_bounds  # noqa: E402
from tinyserve_trt.ops.graph_builder import GraphBuilder  # noqa: E402
from tinyserve_trt.ops.policies import get_policy  # noqa: E402

HKV, GS, D, R = 3, 3, 64, 8  # SmolLM2: 3 KV heads of 3 query heads, head dim 64; page 32 / sub-page 4
INPUTS = dict(pool=T.UINT8, kmin=T.FLOAT, kmax=T.FLOAT, phys=T.INT64, qg=T.FLOAT, coarse=T.FLOAT)


def c(b, v, dt=np.int64):
    return b.const(v, dt)


def rows(b, pool, per_page):  # [P, Hkv, a, D] -> [B, Hkv, K1, a, D] (per_page) or [B, Hkv, r, K1, D]
    idx = b.op("Add", b.op("Mul", "phys", c(b, HKV)), c(b, np.arange(HKV).reshape(1, -1, 1)))
    if per_page:
        return b.op("Gather", b.op("Reshape", pool, c(b, [-1, R if pool == "pool" else 1, D])), idx, axis=0)
    idx = b.op("Add", b.op("Mul", b.unsqueeze(idx, [2]), c(b, R)), c(b, np.arange(R).reshape(1, 1, -1, 1)))
    return b.op("Gather", b.op("Reshape", pool, c(b, [-1, D])), idx, axis=0)  # a 64-byte row each


def step(b):
    return b.op("Mul", b.op("Sub", rows(b, "kmax", True), rows(b, "kmin", True)), b.const(fine_bounds.INV_LEVELS))


def body(b):
    red = lambda x, axis: b.reduce("ReduceMax", x, [axis])  # noqa: E731
    return get_policy("query_aware").sub_page_score_onnx(b, "qg", "coarse", rows(b, "pool", True), step(b), red)


def weights(b):  # q_neg and -(q_pos + 16 q_neg): the weights of code*step and hi*step
    q_pos = b.op("Relu", "qg")
    q_neg = b.op("Sub", "qg", q_pos)
    return q_neg, b.op("Neg", b.op("Add", q_pos, b.op("Mul", q_neg, b.const(np.float32(16)))))


def alt(b, form):
    """nat: codes as gathered, step broadcast over r in spans of D; rk: gathered sub-page-major
    [B, Hkv, r, K1, D]; shift: hi = Cast(codes >> 4) (BitShift) in the body's layout; axis: codes
    [B, Hkv, D, K1, r], Cast*step a per-axis DequantizeLinear; qside: step times the queries
    [B, Hkv, K1, G*S, D], one small GEMM per candidate page."""
    codes, st = rows(b, "pool", form != "rk"), step(b)
    q_neg, w_hi = weights(b)
    if form == "shift":  # [r, B, Hkv, K1, D]; the body's layout
        ct = b.op("Transpose", codes, perm=[3, 0, 1, 2, 4])
        lv = [b.op("Cast", x, to=T.FLOAT) for x in (ct, b.op("BitShift", ct, c(b, 4, np.uint8), direction="RIGHT"))]
        st = b.op("Squeeze", st, c(b, [3]))
        s = [b.op("MatMul", w, b.op("Transpose", b.op("Mul", x, st), perm=[0, 1, 2, 4, 3])) for w, x in zip((q_neg, w_hi), lv)]
        return b.op("Transpose", b.reduce("ReduceMax", b.op("Add", b.op("Add", *s), "coarse"), [3]), perm=[1, 2, 3, 0])
    if form == "qside":
        lv = [b.op("Cast", x, to=T.FLOAT) for x in (codes, b.op("BitShift", codes, c(b, 4, np.uint8), direction="RIGHT"))]
        s = [b.op("MatMul", b.op("Mul", b.unsqueeze(w, [2]), st), b.op("Transpose", x, perm=[0, 1, 2, 4, 3]))
             for w, x in zip((q_neg, w_hi), lv)]  # [B, Hkv, K1, G*S, r]
        s = b.op("Add", b.op("Add", *s), b.unsqueeze(b.op("Transpose", "coarse", perm=[0, 1, 3, 2]), [4]))
        return b.reduce("ReduceMax", s, [3])
    if form == "axis":
        ct = b.op("Transpose", codes, perm=[0, 1, 4, 2, 3])
        scale = b.op("Reshape", b.op("Transpose", st, perm=[0, 1, 4, 2, 3]), c(b, [-1]))
        hi = b.op("Cast", b.op("DequantizeLinear", ct, b.const(np.float32(1 / 16))), to=T.UINT8)
        lv = [b.op("Reshape", b.op("Reshape", b.op("DequantizeLinear", b.op("Reshape", x, c(b, [-1, R])), scale, axis=0),
                                   b.op("Shape", ct)), c(b, [0, 0, 0, -1])) for x in (ct, hi)]
        s = b.op("Add", b.op("MatMul", q_neg, lv[0]), b.op("MatMul", w_hi, lv[1]))  # [B, Hkv, G*S, K1*r]
    else:  # nat, rk
        x = b.op("Cast", codes, to=T.FLOAT)
        st = b.op("Transpose", st, perm=[0, 1, 3, 2, 4]) if form == "rk" else st
        lv = [b.op("Mul", y, st) for y in (x, b.op("Floor", b.op("Mul", x, b.const(np.float32(1 / 16)))))]
        s = b.op("Add", *(b.op("MatMul", w, b.op("Transpose", b.op("Reshape", y, c(b, [0, 0, -1, D])), perm=[0, 1, 3, 2]))
                          for w, y in zip((q_neg, w_hi), lv)))
    if form == "rk":
        s = b.op("Add", b.op("Reshape", s, c(b, [0, 0, 0, R, -1])), b.unsqueeze("coarse", [3]))
        return b.op("Transpose", b.reduce("ReduceMax", s, [2]), perm=[0, 1, 3, 2])
    return b.reduce("ReduceMax", b.op("Add", b.op("Reshape", s, c(b, [0, 0, 0, -1, R])), b.unsqueeze("coarse", [4])), [2])


FORMS = {"body": (body, None), "nat": (alt, "nat"), "rk": (alt, "rk"), "shift": (alt, "shift"),
         "axis": (alt, "axis"), "qside": (alt, "qside")}


def session(name, opset, threads):
    b = GraphBuilder("v", opset)
    fn, form = FORMS[name]
    b.op("Identity", fn(b) if form is None else fn(b, form), _name="fine")  # [B, Hkv, K1, r]
    g = helper.make_graph(b.nodes, "stage2", [helper.make_tensor_value_info(n, t, None) for n, t in INPUTS.items()],
                          [helper.make_tensor_value_info("fine", T.FLOAT, None)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle sessions must not spin
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def make_inputs(rng, B, K1, n=250):  # 8K context: 250 pages of 32 a sequence, K1 of them candidates
    P = B * n
    pool = (rng.integers(0, 8, (P, HKV, R, D)) + 16 * rng.integers(0, 8, (P, HKV, R, D))).astype(np.uint8)  # lo <= hi
    kmin = rng.standard_normal((P, HKV, D)).astype(np.float32)
    kmax = kmin + 2 * rng.random((P, HKV, D)).astype(np.float32)
    phys = np.array([[b * n + rng.choice(n, K1, replace=False) for _ in range(HKV)] for b in range(B)])
    qg = rng.standard_normal((B, HKV, GS, D)).astype(np.float32)
    lo, hi = fine_bounds.decode(pool, kmin, kmax)
    h = np.arange(HKV)[None, :, None]
    q = qg.astype(np.float64)[:, :, :, None, None]  # [B, Hkv, G*S, 1, 1, D]
    lo, hi, mn, mx = lo[phys, h][:, :, None], hi[phys, h][:, :, None], kmin[phys, h][:, :, None], kmax[phys, h][:, :, None]
    coarse = np.maximum(q[..., 0, :] * mn, q[..., 0, :] * mx).sum(-1).astype(np.float32)  # [B, Hkv, G*S, K1]
    exact = np.maximum(q * lo, q * hi).sum(-1).max(2)  # [B, Hkv, K1, r]
    return dict(pool=pool, kmin=kmin, kmax=kmax, phys=phys, qg=qg, coarse=coarse), exact


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k1", type=int, default=125, help="candidate pages (8K context, page 32, share 0.5)")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--forms", nargs="+", default=["body:17", "body:21", "nat:17", "rk:17", "shift:17", "axis:17",
                                                      "qside:17"], help="name:opset")
    a = ap.parse_args(argv)
    sess = {f: session(f.split(":")[0], int(f.split(":")[1]), a.threads) for f in a.forms}
    res = {}
    for B in a.batch:
        feeds, exact = make_inputs(np.random.default_rng(0), B, a.k1)
        for f, s in sess.items():
            err = np.abs(s.run(None, feeds)[0] - exact).max() / np.abs(exact).max()
            if err > 1e-5:
                raise SystemExit(f"{f}: relative error {err:.2e} vs the float64 decode")
        times = {f: [] for f in sess}
        for _ in range(a.rounds):
            for f, s in sess.items():
                t = time.perf_counter()
                s.run(None, feeds)
                times[f].append(time.perf_counter() - t)
        res[B] = {f: statistics.median(t) * 1e3 for f, t in times.items()}
    first = a.forms[0]
    print(f"| form:opset | {' | '.join(f'b{B} ms' for B in a.batch)} | {' | '.join(f'b{B} / {first}' for B in a.batch)} |")
    print("|---|" + "---|" * 2 * len(a.batch))
    for f in sess:
        print(f"| {f} | " + " | ".join(f"{res[B][f]:.3f}" for B in a.batch) + " | "
              + " | ".join(f"{res[B][f] / res[B][first]:.2f}" for B in a.batch) + " |")


if __name__ == "__main__":
    main()
