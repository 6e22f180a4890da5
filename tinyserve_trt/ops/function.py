"""The ONNX-function body of QueryAwareSparseAttention (standard ops only).

ONNX Runtime runs it natively; TensorRT ignores it and imports the plugin
(the node carries ``plugin_namespace``). One body per overload
(``OpAttributes.function_overload``): the selection policy shapes the graph;
``scale``, ``sink_pages`` and ``recent_pages`` are attribute references, so
layers with different values share a body.

Cold pages (overload ``<policy>_int8`` / ``_int4``): a page id ``>= P`` reads the
cold pools and multiplies by its scale (INT4: unpacked first, keys on the page or, two-level,
sub-page bounds, values asymmetric: ``ops/int4_onnx.py``). Both pools must hold at least one page
(``P >= 1`` and ``Pcold >= 1``: the clipped gathers need a row to read); a
tiered pool always has both, and a cache with no cold pages uses the plain
overload.

Decode (S == 1): gather only the selected pages (TopK over page scores), so
the bytes read scale with the budget, not the context. Prefill (S > 1): every
valid page, causal over the new tokens - K becomes the page count. A step in
which every row keeps all its pages (prefill, budget 0, a context within the
budget) takes the ``then`` branch of an ``If`` (``ops/if_branches.py``): the pages
in page-table order, no scoring, no TopK, no sub-page gathers - the same tokens
attended, so the same result up to float summation order.

Two-level (overload ``..._two_level``, ``sub_page_size`` > 0): the selection
is ``ops/two_level_onnx.py`` (a second TopK over the candidates' sub-pages)
and K/V are gathered by sub-page; the attention below is shared.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import onnx
from onnx import TensorProto, helper

from . import schema
from .graph_builder import GraphBuilder
from .int4_onnx import dequantize_int4_keys, dequantize_int4_rows
from .policies import OnnxScoreContext, get_policy
from .if_branches import if_branches
from .two_level_onnx import two_level_counts, two_level_selection

F = TensorProto.FLOAT
I64 = TensorProto.INT64
MIN_OPSET = 15  # CastLike
# what a layer attends: gathered K/V [B, Hkv, K, ps|sp, D], selected pages, which of the T key slots are real
_KEPT = dict(keys=None, vals=None, selected=TensorProto.BOOL, tok_ok=TensorProto.BOOL)  # None: the pool's


def _attr_protos() -> list[onnx.AttributeProto]:
    return [helper.make_attribute(a.name, a.default) for a in schema.ATTRIBUTES]


def make_function(attrs: schema.OpAttributes, cold_pages: bool = False, opset: int = schema.OPSET,
                  cold_format: str = "int8") -> onnx.FunctionProto:
    """The FunctionProto for the overload that ``attrs`` (and the page tiers) select.

    ``opset`` is the model's ai.onnx version: a function must import the same
    one as its model, so the body is written for every opset from MIN_OPSET."""
    if opset < MIN_OPSET:
        raise ValueError(f"ai.onnx opset {opset} is too old for the op's function (needs >= {MIN_OPSET})")
    policy = get_policy(attrs.policy)
    two_level = attrs.two_level
    b = GraphBuilder("qsa", opset)
    q, k, v, kc, vc, kmin, kmax, pt, past, budget = schema.INPUT_NAMES[: schema.NUM_REQUIRED_INPUTS]
    kc8, vc8, kscale, vscale = schema.COLD_INPUTS
    i64 = lambda *xs: b.const(list(xs), np.int64, "i")  # noqa: E731

    # --- shapes -------------------------------------------------------------
    # Every dim is read from the input that every layer shares (page_table) or whose dims
    # are static in an export (the page pool), never from a per-layer activation but S:
    # an exporter can then merge the per-step bookkeeping below across layers.
    B, NP = b.dim(pt, 0), b.dim(pt, 1)
    Hkv, ps, D = b.dim(kc, 1), b.dim(kc, 2), b.dim(kc, 3)
    S = b.dim(q, 2)

    qg = b.op("Reshape", b.op("Cast", q, to=F), b.cat(B, Hkv, i64(-1), D))  # [B, Hkv, G*S, D]
    GS = b.op("Mul", b.op("Div", b.dim(q, 1), Hkv), S)
    kf, vf = b.op("Cast", k, to=F), b.op("Cast", v, to=F)
    zero, one = b.const(0, np.int64), b.const(1, np.int64)
    scale_attr = b.attr_const("scale", "float")
    inv_sqrt_d = b.op("Reciprocal", b.op("Sqrt", b.op("Cast", D, to=F)))
    scale = b.op("Where", b.op("Greater", scale_attr, b.const(0.0, np.float32)), scale_attr, inv_sqrt_d)

    # --- which pages: validity, forced pages, per-sequence keep count k_b -----
    past64 = b.op("Cast", past, to=I64)  # [B]
    n_b = b.op("Div", b.op("Add", past64, b.op("Sub", ps, one)), ps)  # pages in use [B]
    page_idx = b.op("Range", zero, b.scalar(NP), one)  # [NP]
    pidx_row = b.unsqueeze(page_idx, [0])  # [1, NP]
    n_col = b.unsqueeze(n_b, [1])  # [B, 1]
    valid = b.op("Less", pidx_row, n_col)  # [B, NP]
    sinks = b.op("Less", pidx_row, b.attr_const("sink_pages", "int"))
    recent = b.op("GreaterOrEqual", pidx_row, b.op("Sub", n_col, b.attr_const("recent_pages", "int")))
    forced = b.op("And", b.op("Or", sinks, recent), valid)
    n_forced = b.reduce("ReduceSum", b.op("Cast", forced, to=I64), [1])  # [B]
    keep_n = b.op("Max", b.op("Div", b.op("Cast", budget, to=I64), ps), n_forced)
    dense_b = b.op("Or", b.op("LessOrEqual", budget, b.const(0, np.int32)), b.op("GreaterOrEqual", keep_n, n_b))
    dense_b = b.op("Or", dense_b, b.op("Greater", S, one))  # selection applies to decode only
    if not policy.selects:
        dense_b = b.op("Or", dense_b, b.const(True, np.bool_))
    k_b = b.op("Where", dense_b, n_b, keep_n)  # [B]

    # --- scores -> top-K pages per (sequence, KV head) ------------------------
    # group_reduce "head": the selection runs per query head (Hs = H selecting heads, each reading
    # its KV head h // G: a group of one), the kept pages' K/V are gathered per query head.
    pt64 = b.op("Cast", pt, to=I64)
    h_idx = b.op("Reshape", b.op("Range", zero, b.scalar(Hkv), one), i64(1, -1, 1))  # [1, Hkv, 1]
    head = attrs.group_reduce == "head"
    Hs, hs_idx = Hkv, h_idx  # the selecting heads, and the KV head each reads
    if head:
        Hs = b.dim(q, 1)
        hs_idx = b.op("Reshape", b.op("Div", b.op("Range", zero, b.scalar(Hs), one), b.op("Div", Hs, Hkv)),
                      i64(1, -1, 1))  # [1, H, 1]: h // G

    def gather_rows(pool, ids, sub=None, cast=True, ra=None, row_dims=None, kv_of=None):
        # pool [N, Hkv, a, c], ids [B, Hkv, K] -> [B, Hkv, K, a, c] float32; row_dims: (a, c) as a per-step
        # value (e.g. a pool [N, Hkv, c] read as a = 1) instead of the pool's Shape; kv_of: the KV head of
        # each of ids' heads ([1, Hkv|H, 1], default h_idx)
        row = b.op("Add", b.op("Mul", ids, Hkv), h_idx if kv_of is None else kv_of)
        if sub is None:
            rows = b.op("Reshape", pool, b.cat(i64(-1), b.dim(pool, 2, 4) if row_dims is None else row_dims))
        else:  # sub = (j [B, Hkv, K], r): sub-page j of each page; a is ps (split in r) or 1 (broadcast)
            j, r = sub  # (ra given: a is split in ra parts, one per slot - the fine codes, a = r_codes)
            a = b.dim(pool, 2)
            if ra is None:
                ra = b.op("Max", b.op("Div", b.op("Mul", a, r), ps), one)  # r, or 1 when a == 1
            rows = b.op("Reshape", pool, b.cat(i64(-1), b.op("Div", a, ra), b.dim(pool, 3)))  # [N*Hkv*ra, a/ra, c]
            row = b.op("Add", b.op("Mul", row, ra), b.op("Div", b.op("Mul", j, ra), r))
        rows = b.op("Gather", rows, row, axis=0)
        return b.op("Cast", rows, to=F) if cast else rows

    def gather_pages(cache, phys, sub=None, flat=True, kv_of=None):
        # phys [B, Hkv, K] -> [B, Hkv, K*(ps|sp), D] float32 (kv_of: as gather_rows, for phys [B, H, K])
        # flat=False: [B, Hkv, K, ps|sp, D] in the pool dtype (hot pages only), for an If branch whose
        # output the caller casts and reshapes: a Cast or Reshape as a branch's output is a copy
        gather_rows_ = partial(gather_rows, kv_of=kv_of)
        if not cold_pages:
            pages = gather_rows_(cache, phys, sub, cast=flat)
        else:
            # Both tiers are gathered with clipped ids and Where picks per page: one
            # static graph for any hot/cold mix (the CUDA kernel branches instead).
            q8, sc = {kc: (kc8, kscale), vc: (vc8, vscale)}[cache]
            P = b.dim(cache, 0)
            is_cold = b.op("GreaterOrEqual", phys, P)
            hot = gather_rows_(cache, b.op("Min", phys, b.op("Sub", P, one)), sub)
            cold_id = b.op("Max", b.op("Sub", phys, P), zero)
            if cold_format == "int4" and cache == kc:  # keys on the page (two-level: sub-page) bounds
                cold = dequantize_int4_keys(b, gather_rows_, q8, kmin, kmax, cold_id, b.op("Max", phys, zero), sub,
                                            schema.TWO_LEVEL_INPUTS[0] if two_level else None)
            elif cold_format == "int4":  # packed nibbles, float16 scales + mins per channel group
                cold = dequantize_int4_rows(b, gather_rows_, q8, sc, cold_id, sub)
            else:
                cold = b.op("Mul", gather_rows_(q8, cold_id, sub), gather_rows_(sc, cold_id, sub))  # int8 * scale
            pages = b.op("Where", b.unsqueeze(is_cold, [3, 4]), cold, hot)
        return b.op("Reshape", pages, b.cat(B, Hkv, i64(-1), D)) if flat else pages

    def minmax_T():
        def t(m):  # [Ptot, Hkv, D] -> [B, NP, Hkv, D] -> [B, Hkv, D, NP]
            return b.op("Transpose", b.op("Cast", b.op("Gather", m, pt64, axis=0), to=F), perm=[0, 2, 3, 1])
        return t(kmin), t(kmax)

    def dense_page_mass():
        all_phys = b.op("Expand", b.unsqueeze(pt64, [1]), b.cat(B, Hkv, NP))
        keys = gather_pages(kc, all_phys)  # [B, Hkv, NP*ps, D]
        tok = b.op("Range", zero, b.scalar(b.op("Mul", NP, ps)), one)
        tok_ok = b.op("Less", b.op("Reshape", tok, i64(1, 1, 1, -1)), b.op("Reshape", past64, i64(-1, 1, 1, 1)))
        probs = attention_probs(keys, tok_ok)  # [B, Hkv, GS, NP*ps + S]
        cached = b.op("Slice", probs, i64(0), b.op("Mul", NP, ps), i64(3))
        return b.reduce("ReduceSum", b.op("Reshape", cached, b.cat(B, Hkv, i64(-1), NP, ps)), [4])

    def masked_logits(queries, keys, tok_ok, new_keys=kf, gs=GS):  # keys [B,Hkv,T,D], tok_ok bool [B|1, Hkv|1, 1, T]
        """(cached [B, Hkv, GS, T], new [B, Hkv, GS, S]) logits of ``queries`` [B, Hkv, GS, D], -inf where masked.
        Cached and new keys are scored by separate MatMuls (a Concat of the keys would copy every
        gathered page once more), each part masked where it is made by a 0 / -inf bias built on the
        small mask tensor: a broadcast Add over the logits is ORT CPU's vectorized path, a Where with
        a broadcast bool condition ~1.4x slower here, and no expanded [B, Hkv, GS, T+S] mask."""
        def logits_of(x):
            return b.op("MatMul", queries, b.op("Transpose", x, perm=[0, 1, 3, 2]))
        s_of_row = b.op("Mod", b.op("Range", zero, b.scalar(gs), one), b.scalar(S))
        causal = b.op("LessOrEqual", b.unsqueeze(b.op("Range", zero, b.scalar(S), one), [0]),
                      b.unsqueeze(s_of_row, [1]))  # [GS, S]: new token j visible from row (g, s) iff j <= s
        zero_f, neg_inf = b.const(0.0, np.float32), b.const(-np.inf, np.float32)
        return (b.op("Add", logits_of(keys), b.op("Where", tok_ok, zero_f, neg_inf)),
                b.op("Add", logits_of(new_keys), b.op("Where", b.unsqueeze(causal, [0, 1]), zero_f, neg_inf)))

    def attention_probs(keys, tok_ok):  # [B, Hkv, GS, T+S] probabilities (the oracle's page mass)
        return b.op("Softmax", b.op("Mul", b.op("Concat", *masked_logits(qg, keys, tok_ok), axis=3), scale), axis=-1)

    page_idx_f = b.op("Reshape", b.op("Cast", page_idx, to=F), i64(1, 1, 1, -1))
    valid3, forced3 = b.unsqueeze(valid, [1]), b.unsqueeze(forced, [1])
    pt_bh = b.op("Expand", b.unsqueeze(pt64, [1]), b.cat(B, Hkv, NP))
    pt_bs = pt_bh if not head else b.op("Expand", b.unsqueeze(pt64, [1]), b.cat(B, Hs, NP))

    def top_k(x, k_per_seq, width=None, heads=Hkv):
        # x [B, heads, N] -> (indices, rank < k_b: [B, heads, Kmax]; Kmax; values)
        # Kmax and the rank mask depend on k_b and N only (not on x): shared by all layers.
        kmax = b.op("Min", b.reduce("ReduceMax", k_per_seq, [0], keepdims=1), b.dim(x, 2) if width is None else width)
        # Only the rank mask needs the order (rows keeping fewer than Kmax). When every row keeps Kmax
        # (one budget, equal lengths) an unsorted TopK picks the same set - ONNX's tie rule, lower index
        # first, holds either way - at up to a third of the cost ([24, 1000] -> 256: 0.09 vs 0.29 ms).
        uniform = b.op("GreaterOrEqual", b.reduce("ReduceMin", k_per_seq, [0], keepdims=1), kmax)  # [1], per step
        branches = []
        for order in (0, 1):
            vals, top = b._name("topk_values"), b._name("topk")
            branches.append(helper.make_graph(
                [helper.make_node("TopK", [x, kmax], [vals, top], axis=-1, largest=1, sorted=order)], f"sorted{order}",
                [], [helper.make_tensor_value_info(vals, F, None), helper.make_tensor_value_info(top, I64, None)]))
        vals, top = b.op_multi("If", [uniform], 2, then_branch=branches[0], else_branch=branches[1])
        rank = b.op("Reshape", b.op("Range", zero, b.scalar(kmax), one), i64(1, 1, -1))
        ok = b.op("Expand", b.op("Less", rank, b.op("Reshape", k_per_seq, i64(-1, 1, 1))), b.cat(B, heads, kmax))
        return top, ok, kmax, vals

    def attended(keys, vals, selected, tok_first, tok_len, tok_ok_rank, heads=Hkv):
        """The kept slots' K/V with the mask of their real tokens ``tok_ok [B, Hkv|H, 1, T]``."""
        tok = b.op("Add", b.unsqueeze(tok_first, [3]),
                   b.op("Reshape", b.op("Range", zero, b.scalar(tok_len), one), i64(1, 1, 1, -1)))  # [B, Hkv, K, len]
        tok_ok = b.op("And", b.op("Less", tok, b.op("Reshape", past64, i64(-1, 1, 1, 1))),
                      b.unsqueeze(tok_ok_rank, [3]))
        tok_ok = b.op("Reshape", tok_ok, b.cat(B, heads, i64(1, -1)))  # [B, Hkv|H, 1, K*len]
        return dict(keys=keys, vals=vals, selected=selected, tok_ok=tok_ok)

    def every_page():  # all valid pages in page-table order: no scores, no TopK
        # Only the first max_b n_b columns of the table hold cached tokens (the rest are the pages
        # this step writes, or padding): gathering and scoring them would attend nothing - half
        # the attention of a first prefill chunk. At least one page, so no tensor is empty.
        every = b.op("Expand", valid3, b.cat(B, Hkv, NP))
        n_max = b.op("Max", b.reduce("ReduceMax", n_b, [0], keepdims=1), one)  # [1]
        used = b.op("Slice", every, i64(0), n_max, i64(2))  # [B, Hkv, n_max]
        phys = b.op("Slice", pt_bh, i64(0), n_max, i64(2))
        first = b.op("Mul", b.op("Reshape", b.op("Slice", page_idx, i64(0), n_max, i64(0)), i64(1, 1, -1)), ps)
        return attended(gather_pages(kc, phys, flat=False), gather_pages(vc, phys, flat=False), every,
                        first, ps, used)

    def kept_pages():  # the policy's pages (or sub-pages): scores -> TopK
        per_head = policy.score_onnx(OnnxScoreContext(b, qg, page_idx_f, minmax_T, dense_page_mass))
        reduce_op = {"max": "ReduceMax", "sum": "ReduceSum", "head": "ReduceMax"}[attrs.group_reduce]
        q_sel, gs_sel = qg, GS
        if head:  # [B, Hkv, G*S, NP] -> [B, H, S, NP]: a KV head's rows are its query heads' (S == 1 here)
            per_head = b.op("Reshape", b.op("Expand", per_head, b.cat(B, Hkv, GS, NP)), b.cat(B, Hs, S, NP))
            q_sel, gs_sel = b.op("Reshape", qg, b.cat(B, Hs, S, D)), S
        scores = b.reduce(reduce_op, per_head, [2])  # [B|1, Hs|1, NP]
        # forced pages +inf, invalid -inf: one Where per layer (the condition and the fill are per-step)
        ranked = b.op("And", valid3, b.op("Not", forced3))
        fill = b.op("Where", forced3, b.const(np.inf, np.float32), b.const(-np.inf, np.float32))
        scores = b.op("Expand", b.op("Where", ranked, scores, fill), b.cat(B, Hs, NP))
        gather = partial(gather_pages, kv_of=hs_idx, flat=False)
        if not two_level:
            top, rank_ok, _, _ = top_k(scores, k_b, NP, heads=Hs)  # [B, Hs, K] logical pages
            selected = b.op("ScatterElements", b.op("Expand", b.const(False, np.bool_), b.cat(B, Hs, NP)), top,
                            rank_ok, axis=2)
            phys = b.op("GatherElements", pt_bs, top, axis=2)
            kept = attended(gather(kc, phys), gather(vc, phys), selected, b.op("Mul", top, ps), ps, rank_ok, Hs)
        else:
            sel = two_level_selection(
                b, counts=counts, scores=scores, coarse_per_head=per_head, top_k=partial(top_k, heads=Hs),
                pt_bh=pt_bs, kmin=kmin, kmax=kmax, sub_bounds=schema.TWO_LEVEL_INPUTS[0],
                gather_rows=partial(gather_rows, kv_of=hs_idx), policy=policy, qg=q_sel, reduce_op=reduce_op,
                ps=ps, NP=NP, n_b=n_b, forced=forced, keep_n=keep_n, B=B, Hkv=Hs, D=D, GS=gs_sel)
            sub = (sel["j"], sel["r"])
            kept = attended(gather(kc, sel["phys"], sub), gather(vc, sel["phys"], sub), sel["selected"],
                            sel["first_token"], sel["sp"], sel["ok"], Hs)
        if head:  # selected_pages: a page any query head of the group attends
            marks = b.op("Reshape", b.op("Cast", kept["selected"], to=TensorProto.INT32), b.cat(B, Hkv, i64(-1), NP))
            kept["selected"] = b.op("Cast", b.reduce("ReduceMax", marks, [2]), to=TensorProto.BOOL)
        return kept

    # A step where every row keeps all its pages (short contexts, budget 0, prefill) skips the
    # selection: an If on the per-step dense switch (the same for every layer) - bit-for-bit the
    # same attended tokens, without scoring, ranking or re-gathering them by sub-page.
    if policy.selects:
        if two_level:  # the sub-page rule's dense rows include the page rule's (a budget covering every
            # written sub-page covers every page): the sparse branch then always has a selecting row
            counts = two_level_counts(b, sub_bounds=schema.TWO_LEVEL_INPUTS[0], past64=past64, budget=budget, ps=ps,
                                      pidx_row=pidx_row, forced=forced, S=S)
            dense_b = b.op("Or", dense_b, counts["dense"])
        all_dense = b.op("Cast", b.reduce("ReduceMin", b.op("Cast", dense_b, to=I64), [0]), to=TensorProto.BOOL)
        kept = if_branches(b, all_dense, every_page, kept_pages, _KEPT, step_inputs=(pt, past, budget),
                           names=dict(selected=schema.OUTPUT_NAMES[1]))
    else:
        kept = every_page()
        kept["selected"] = b.op("Identity", kept["selected"], _name=schema.OUTPUT_NAMES[1])
    # X heads attend: Hkv (a group shares its kept keys), or with "head" in a selecting step H (each
    # query head its own; the every-page branch still gives Hkv). Queries and new tokens follow X.
    X, q_att, new_k, new_v = Hkv, qg, kf, vf
    if head:
        X = b.dim(kept["keys"], 1)
        q_att = b.op("Reshape", qg, b.cat(B, X, i64(-1), D))
        new_k, new_v = (b.op("Reshape", b.op("Expand", b.unsqueeze(x, [2]), b.cat(B, Hkv, b.op("Div", X, Hkv), S, D)),
                              b.cat(B, X, S, D)) for x in (kf, vf))
    keys, vals = (b.op("Reshape", b.op("Cast", kept[x], to=F), b.cat(B, X, i64(-1), D))  # [B, X, T, D]
                  for x in ("keys", "vals"))
    tok_ok = kept["tok_ok"]

    # --- attention over the kept pages (or sub-pages) + the new tokens --------
    # A softmax in two parts, cached and new keys, sharing one row max and one denominator: no
    # Concat of the [B, Hkv, G*S, T+S] logits, no Slices of the probabilities, and the scale on the
    # [.., D] queries instead of the logits - four fewer passes over the largest tensor a prefill
    # chunk makes (SmolLM2, a 512-token chunk at 2K: those passes were ~45% of the chunk's time).
    # Every row sees its own token, so the max is finite and the denominator >= 1.
    cached, new = masked_logits(b.op("Mul", q_att, scale), keys, tok_ok, new_k, b.dim(q_att, 2) if head else GS)
    m = b.op("Max", b.reduce("ReduceMax", cached, [3], keepdims=1), b.reduce("ReduceMax", new, [3], keepdims=1))
    e_cached, e_new = (b.op("Exp", b.op("Sub", x, m)) for x in (cached, new))
    den = b.op("Add", b.reduce("ReduceSum", e_cached, [3], keepdims=1), b.reduce("ReduceSum", e_new, [3], keepdims=1))
    out = b.op("Div", b.op("Add", b.op("MatMul", e_cached, vals), b.op("MatMul", e_new, new_v)), den)  # [B,X,GS|S,D]
    b.op("CastLike", b.op("Reshape", out, b.cat(B, i64(-1), S, D)), q, _name=schema.OUTPUT_NAMES[0])

    fn = helper.make_function(
        schema.DOMAIN, schema.OP_TYPE, list(schema.INPUT_NAMES), list(schema.OUTPUT_NAMES), b.nodes,
        [helper.make_opsetid("", opset)], attributes=[],
        overload=attrs.function_overload(cold_pages, cold_format),
    )
    fn.attribute_proto.extend(_attr_protos())
    fn.doc_string = f"{schema.OP_TYPE} v{schema.VERSION}, policy={attrs.policy}, group_reduce={attrs.group_reduce}"
    return fn
