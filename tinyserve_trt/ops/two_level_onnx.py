"""The two-level selection of the ONNX function body (``ops/two_level.py`` is the rule).

A first TopK keeps the candidate pages by the coarse scores; their compact
sub-page bounds (``key_sub_bounds``, ``ops/fine_bounds.py``) are gathered
and scored by the policy's ``sub_page_score_onnx`` from the codes and the
candidates' per-head coarse scores (no decoded lo/hi tensors); a second TopK
over the candidates' sub-pages keeps the forced pages' written sub-pages (score +inf)
and the best others. Only the candidates' fine bounds are read, so the cost
per step lies between page size and sub-page size. Standard ops only.

:func:`two_level_counts` is the per-step part (sub-page counts, keep counts, which
rows are dense): the body computes it before its ``If``, so the ``If`` takes the
every-page branch exactly when every row is dense by this rule (a budget that
covers every written sub-page covers every page: the page rule's dense rows are
dense here too), and :func:`two_level_selection`, the sparse branch, never sees a
step with no selecting row: no whole-page fallback inside it. The per-step values
stay outside the branch, where an exporter merges them across layers.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from .fine_bounds import INV_LEVELS

F = TensorProto.FLOAT
I64 = TensorProto.INT64


def two_level_counts(b, *, sub_bounds, past64, budget, ps, pidx_row, forced, S) -> dict:
    """Per-step values of the two-level rule (no layer tensor is read: the sub-page count ``r``
    is a dim of ``key_sub_bounds``): ``r``, ``sp`` (``[1]`` int64), ``n_sub`` (written sub-pages
    ``[B]``), ``keep2`` (sub-pages kept ``[B]``) and ``dense`` (``[B]`` bool: the row keeps
    everything - budget <= 0, a budget covering every written sub-page, or prefill)."""
    zero, one = b.const(0, np.int64), b.const(1, np.int64)
    r = b.dim(sub_bounds, 2)
    sp = b.op("Div", ps, r)
    n_sub = b.op("Div", b.op("Add", past64, b.op("Sub", sp, one)), sp)  # written sub-pages [B]
    in_page = b.op("Min", b.op("Max", b.op("Sub", b.unsqueeze(n_sub, [1]), b.op("Mul", pidx_row, r)), zero), r)
    n_forced_sub = b.reduce("ReduceSum", b.op("Where", forced, in_page, zero), [1])  # [B]
    keep2 = b.op("Max", b.op("Div", b.op("Cast", budget, to=I64), sp), n_forced_sub)
    dense = b.op("Or", b.op("LessOrEqual", budget, b.const(0, np.int32)), b.op("GreaterOrEqual", keep2, n_sub))
    dense = b.op("Or", dense, b.op("Greater", S, one))  # prefill attends everything
    return dict(r=r, sp=sp, n_sub=n_sub, keep2=keep2, dense=dense)


def two_level_selection(b, *, counts, scores, coarse_per_head, top_k, pt_bh, kmin, kmax, sub_bounds, gather_rows, policy,
                        qg, reduce_op, ps, NP, n_b, forced, keep_n, B, Hkv, D, GS) -> dict:
    """Kept sub-pages of each (sequence, KV head) as ONNX tensors, for a step in which at least
    one row selects (``counts``: :func:`two_level_counts`; a dense row keeps all its pages'
    written sub-pages).

    scores: ``[B, Hkv, NP]`` coarse scores (-inf invalid, +inf forced); coarse_per_head
    ``[B, Hkv, G*S, NP]`` the policy's per-head scores before the group reduce; forced ``[B, NP]``;
    keep_n ``[B]`` = ``max(budget // ps, #forced)``; ``top_k(x, k_b, width)`` -> (indices, rank < k_b,
    Kmax, values). Returns ``phys``/``j`` (physical page, sub-page in it) ``[B, Hkv, K2]``, ``ok``
    (bool, slot used), ``first_token`` (logical token index of each
    slot), ``selected`` ``[B, Hkv, NP]`` (page has a kept sub-page), ``r`` and ``sp`` (``[1]``
    int64): the sub-pages per page and the slot's tokens.
    """
    def i64(*xs):
        return b.const(list(xs), np.int64, "i")
    zero, one = b.const(0, np.int64), b.const(1, np.int64)
    r, sp, n_sub, keep2, dense = (counts[k] for k in ("r", "sp", "n_sub", "keep2", "dense"))

    # --- level 1: candidate pages ---------------------------------------------
    share = b.attr_const("candidate_share", "float")
    by_share = b.op("Cast", b.op("Floor", b.op("Mul", share, b.op("Cast", n_b, to=F))), to=I64)
    k1 = b.op("Where", dense, n_b, b.op("Min", b.op("Max", by_share, keep_n), n_b))
    top1, ok1, kmax1, _ = top_k(scores, k1, NP)  # [B, Hkv, K1] logical pages
    phys1 = b.op("GatherElements", pt_bh, top1, axis=2)
    forced1 = b.op("GatherElements", b.op("Expand", b.unsqueeze(forced, [1]), b.cat(B, Hkv, NP)), top1, axis=2)
    # forced candidates rank first (+inf), slots past a row's K1 never (-inf): a bias per candidate page
    # on its coarse scores, which every sub-page score adds - no masks over the [B, Hkv, K1*r] scores
    inf, ninf = b.const(np.inf, np.float32), b.const(-np.inf, np.float32)
    bias = b.op("Where", forced1, inf, b.op("Where", ok1, b.const(0.0, np.float32), ninf))  # [B, Hkv, K1]

    # --- level 2: the candidates' sub-pages, scored from their compact bounds ---
    def page_rows(m):  # [Ptot, Hkv, D] -> [B, Hkv, K1, 1, D] float32 (rows [Ptot*Hkv, 1, D]: a per-step shape)
        return gather_rows(m, phys1, row_dims=b.cat(i64(1), D))
    step = b.op("Mul", b.op("Sub", page_rows(kmax), page_rows(kmin)), b.const(INV_LEVELS, np.float32))
    codes = gather_rows(sub_bounds, phys1, cast=False)  # [B, Hkv, K1, r, D] uint8
    coarse = b.op("GatherElements", coarse_per_head,
                  b.op("Expand", b.unsqueeze(top1, [2]), b.cat(B, Hkv, GS, kmax1)), axis=3)  # [B, Hkv, GS, K1]
    coarse = b.op("Add", coarse, b.unsqueeze(bias, [2]))
    fine = policy.sub_page_score_onnx(b, qg, coarse, codes, step, lambda x, axis: b.reduce(reduce_op, x, [axis]),
                                      dims=dict(bh=b.cat(B, Hkv), k1=kmax1, r=r, d=D, gs=GS))  # [B, Hkv, K1, r]
    k1r = b.op("Mul", kmax1, r)  # per step (the candidates' slots): not -1 in the reshapes, K1 may be 0
    # only written sub-pages (the last page's tail is not): j < n_sub - page * r
    left = b.op("Sub", b.op("Reshape", n_sub, i64(-1, 1, 1)), b.op("Mul", top1, r))  # [B, Hkv, K1]
    written = b.op("Less", b.op("Reshape", b.op("Range", zero, b.scalar(r), one), i64(1, 1, 1, -1)),
                   b.unsqueeze(left, [3]))  # [B, Hkv, K1, r]
    fine = b.op("Reshape", b.op("Where", written, fine, ninf), b.cat(B, Hkv, k1r))  # [B, Hkv, K1*r]
    top2, ok2, k2, val2 = top_k(fine, b.op("Where", dense, n_sub, keep2), k1r)  # [B, Hkv, K2]
    ok2 = b.op("And", ok2, b.op("Greater", val2, ninf))  # too few candidates: keep what there is

    slot, j = b.op("Div", top2, r), b.op("Mod", top2, r)
    logical = b.op("GatherElements", top1, slot, axis=2)
    # a page is selected if any of its sub-pages is; unused slots write to a scratch column NP
    target = b.op("Where", ok2, logical, NP)
    marks = b.op("ScatterElements", b.op("Expand", b.const(False, np.bool_), b.cat(B, Hkv, b.op("Add", NP, one))),
                 target, b.op("Expand", b.const(True, np.bool_), b.cat(B, Hkv, k2)), axis=2)
    return dict(selected=b.op("Slice", marks, i64(0), NP, i64(2)), phys=b.op("GatherElements", phys1, slot, axis=2),
                j=j, ok=ok2, first_token=b.op("Add", b.op("Mul", logical, ps), b.op("Mul", j, sp)),
                r=r, sp=sp)
