"""The two-level selection of the ONNX function body (``ops/two_level.py`` is the rule).

A first TopK keeps the candidate pages by the coarse scores; their compact
sub-page bounds (``key_sub_bounds``, ``ops/fine_bounds.py``) are gathered
and scored by the policy's ``sub_page_score_onnx`` from the codes and the
candidates' per-head coarse scores (no decoded lo/hi tensors); a second TopK
over the candidates' sub-pages keeps the forced pages' written sub-pages (score +inf)
and the best others. Only the candidates' fine bounds are read, so the cost
per step lies between page size and sub-page size. Standard ops only.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from .fine_bounds import INV_LEVELS

F = TensorProto.FLOAT
I64 = TensorProto.INT64


def two_level_selection(b, *, scores, coarse_per_head, top_k, pt_bh, kmin, kmax, sub_bounds, gather_rows, policy, qg, reduce_op,
                        past64, budget, ps, NP, n_b, pidx_row, forced, keep_n, S, B, Hkv, D) -> dict:
    """Kept sub-pages of each (sequence, KV head) as ONNX tensors.

    scores: ``[B, Hkv, NP]`` coarse scores (-inf invalid, +inf forced); coarse_per_head
    ``[B, Hkv, G*S, NP]`` the policy's per-head scores before the group reduce; forced ``[B, NP]``;
    keep_n ``[B]`` = ``max(budget // ps, #forced)``; ``top_k(x, k_b)`` -> (indices, rank < k_b, Kmax, values).
    Returns ``phys``/``j`` (physical page, sub-page in it) ``[B, Hkv, K2]``, ``ok`` (bool, slot
    used), ``slots`` (``K2``, ``[1]``), ``first_token`` (logical token index of each slot),
    ``selected`` ``[B, Hkv, NP]`` (page has a kept sub-page), ``r`` and ``sp`` (``[1]`` int64): the
    sub-pages per slot and the slot's tokens. When every sequence is dense (a budget that covers
    it, budget <= 0, prefill), the slots are whole pages (``r`` 1, ``sp`` ps, ``j`` 0) and the
    two TopKs and the fine scores run on empty tensors: a dense step costs what the
    single-level op's does.
    """
    def i64(*xs):
        return b.const(list(xs), np.int64, "i")
    zero, one = b.const(0, np.int64), b.const(1, np.int64)
    r = b.dim(sub_bounds, 2)
    sp = b.op("Div", ps, r)
    n_sub = b.op("Div", b.op("Add", past64, b.op("Sub", sp, one)), sp)  # written sub-pages [B]
    in_page = b.op("Min", b.op("Max", b.op("Sub", b.unsqueeze(n_sub, [1]), b.op("Mul", pidx_row, r)), zero), r)
    n_forced_sub = b.reduce("ReduceSum", b.op("Where", forced, in_page, zero), [1])  # [B]
    keep2 = b.op("Max", b.op("Div", b.op("Cast", budget, to=I64), sp), n_forced_sub)
    dense = b.op("Or", b.op("LessOrEqual", budget, b.const(0, np.int32)), b.op("GreaterOrEqual", keep2, n_sub))
    dense = b.op("Or", dense, b.op("Greater", S, one))  # prefill attends everything
    # 1 if any sequence selects, else 0 (a per-step value): when every sequence is dense, the
    # sub-page tensors below are empty and whole pages are gathered instead (the dense part)
    sparse_any = b.reduce("ReduceMax", b.op("Cast", b.op("Not", dense), to=I64), [0], keepdims=1)  # [1]

    # --- level 1: candidate pages ---------------------------------------------
    share = b.attr_const("candidate_share", "float")
    by_share = b.op("Cast", b.op("Floor", b.op("Mul", share, b.op("Cast", n_b, to=F))), to=I64)
    k1 = b.op("Mul", b.op("Where", dense, n_b, b.op("Min", b.op("Max", by_share, keep_n), n_b)), sparse_any)
    top1, ok1, _, _ = top_k(scores, k1, NP)  # [B, Hkv, K1] logical pages
    phys1 = b.op("GatherElements", pt_bh, top1, axis=2)
    forced1 = b.op("GatherElements", b.op("Expand", b.unsqueeze(forced, [1]), b.cat(B, Hkv, NP)), top1, axis=2)
    # forced candidates rank first (+inf), slots past a row's K1 never (-inf): a bias per candidate page
    # on its coarse scores, which every sub-page score adds - no masks over the [B, Hkv, K1*r] scores
    inf, ninf = b.const(np.inf, np.float32), b.const(-np.inf, np.float32)
    bias = b.op("Where", forced1, inf, b.op("Where", ok1, b.const(0.0, np.float32), ninf))  # [B, Hkv, K1]

    # --- level 2: the candidates' sub-pages, scored from their compact bounds ---
    def page_rows(m):  # [Ptot, Hkv, D] -> [B, Hkv, K1, 1, D] float32
        return gather_rows(b.unsqueeze(m, [2]), phys1)
    step = b.op("Mul", b.op("Sub", page_rows(kmax), page_rows(kmin)), b.const(INV_LEVELS, np.float32))
    codes = gather_rows(sub_bounds, phys1, cast=False)  # [B, Hkv, K1, r, D] uint8
    GS = b.dim(qg, 2)
    coarse = b.op("GatherElements", coarse_per_head,
                  b.op("Expand", b.unsqueeze(top1, [2]), b.cat(B, Hkv, GS, b.dim(top1, 2))), axis=3)  # [B, Hkv, GS, K1]
    coarse = b.op("Add", coarse, b.unsqueeze(bias, [2]))
    fine = policy.sub_page_score_onnx(b, qg, coarse, codes, step,
                                      lambda x, axis: b.reduce(reduce_op, x, [axis]))  # [B, Hkv, K1, r]
    k1r = b.op("Mul", b.dim(top1, 2), r)  # not -1 in the reshapes: K1 may be 0
    # only written sub-pages (the last page's tail is not): j < n_sub - page * r
    left = b.op("Sub", b.op("Reshape", n_sub, i64(-1, 1, 1)), b.op("Mul", top1, r))  # [B, Hkv, K1]
    written = b.op("Less", b.op("Reshape", b.op("Range", zero, b.scalar(r), one), i64(1, 1, 1, -1)),
                   b.unsqueeze(left, [3]))  # [B, Hkv, K1, r]
    fine = b.op("Reshape", b.op("Where", written, fine, ninf), b.cat(B, Hkv, k1r))  # [B, Hkv, K1*r]
    top2, ok2, k2, val2 = top_k(fine, b.op("Mul", b.op("Where", dense, n_sub, keep2), sparse_any))  # [B, Hkv, K2]
    ok2 = b.op("And", ok2, b.op("Greater", val2, ninf))  # too few candidates: keep what there is

    slot, j = b.op("Div", top2, r), b.op("Mod", top2, r)
    logical = b.op("GatherElements", top1, slot, axis=2)
    # a page is selected if any of its sub-pages is; unused slots write to a scratch column NP
    target = b.op("Where", ok2, logical, NP)
    marks = b.op("ScatterElements", b.op("Expand", b.const(False, np.bool_), b.cat(B, Hkv, b.op("Add", NP, one))),
                 target, b.op("Expand", b.const(True, np.bool_), b.op("Shape", target)), axis=2)

    # --- the dense part: every page whole, present only when no sequence selects ---
    np_d = b.op("Mul", NP, b.op("Sub", one, sparse_any))  # NP or 0
    logical_d = b.op("Expand", b.op("Reshape", b.op("Range", zero, b.scalar(np_d), one), i64(1, 1, -1)),
                     b.cat(B, Hkv, np_d))  # [B, Hkv, NP | 0]
    valid_d = b.op("Less", logical_d, b.op("Reshape", n_b, i64(-1, 1, 1)))
    all_valid = b.op("Less", pidx_row, b.unsqueeze(n_b, [1]))  # [B, NP]
    dense_marks = b.op("And", b.unsqueeze(all_valid, [1]), b.op("Equal", sparse_any, zero))
    r_eff = b.op("Add", b.op("Mul", b.op("Sub", r, one), sparse_any), one)  # sub-pages per gathered slot

    def both(x, y):
        return b.op("Concat", x, y, axis=2)
    return dict(selected=b.op("Or", b.op("Slice", marks, i64(0), NP, i64(2)), dense_marks),
                phys=both(b.op("GatherElements", phys1, slot, axis=2), b.op("Slice", pt_bh, i64(0), np_d, i64(2))),
                j=both(j, b.op("Mul", logical_d, zero)), ok=both(ok2, valid_d), slots=b.op("Add", k2, np_d),
                first_token=both(b.op("Add", b.op("Mul", logical, ps), b.op("Mul", j, sp)), b.op("Mul", logical_d, ps)),
                r=r_eff, sp=b.op("Div", ps, r_eff))
