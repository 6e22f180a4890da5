"""The validation half of ``gpu_check.py``: the CUDA kernels against the numpy reference.

Cases and checks only (no timing): ``gpu_check.py`` runs them first, then times.
Every case is built on an explicit ``device`` ("cuda", or "cpu" for the
CPU-emulated library), never from a module global, so ``--emulated`` cannot
leave a case on the wrong device.

* ``make_gpu_case`` + ``check_numpy`` / ``check_torch_dense``: one configuration of the
  decode grid, its first and last sequence vs numpy ``sparse_attention_ref`` (selection by
  reference scores, output vs attention over the kept pages) and, dense, every sequence
  vs torch fp32 attention.
* ``check_mixed``: hot + INT8 and hot + packed INT4 cold pages (K per channel, V per token;
  INT4 V in groups of 32 channels), decode at a sparse and a dense budget and a 4-token
  prefill, every sequence vs numpy and vs the reference on the dequantized all-hot cache.
* ``check_two_level``: two-level decode's kept sub-pages vs ``ops.two_level`` by reference
  sub-page scores, and the output vs attention over exactly those sub-pages.
Each raises AssertionError on a mismatch and returns report rows.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from tinyserve_dev.cases import CaseSpec, dequantized_float32_case, make_case, make_mixed_case
from tinyserve_dev.kernels.harness import ForwardCall, sparse_attention_gpu
from tinyserve_dev.kernels.references import (attention_with_selection_ref,
                                              kept_sub_pages_ref, selection_score_gap, sub_page_selection_gap,
                                              units_mask)
from tinyserve_trt.ops import schema, sparse_attention_ref

HKV, D, PS = 8, 128, 16


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_gpu_case(torch, B, G, ctx, budget, seed, device="cuda"):
    """Inputs by schema name on ``device`` ("cuda", or "cpu" for the emulated library), fp16.
    Pages shuffled in the pool; exact min/max."""
    g = torch.Generator(device=device).manual_seed(seed)
    H = HKV * G
    past = [max(1, ctx - 1 - (b * 37) % max(1, ctx // 4)) for b in range(B)]
    n = [-(-p // PS) for p in past]
    NP = max(n)
    P = sum(n)
    kc = torch.randn(P, HKV, PS, D, device=device, generator=g, dtype=torch.float16)
    kc *= (1 + 4 * (torch.rand(D, device=device, generator=g) < 0.1)).half()  # outlier channels
    vc = torch.randn(P, HKV, PS, D, device=device, generator=g, dtype=torch.float16)
    perm = torch.randperm(P, device=device, generator=g).int()
    table = torch.zeros(B, NP, dtype=torch.int32, device=device)
    kmin, kmax = kc.amin(dim=2), kc.amax(dim=2)
    off = 0
    for b in range(B):
        table[b, : n[b]] = perm[off: off + n[b]]
        table[b, n[b]:] = perm[off]  # padding: a valid id, ignored
        valid = past[b] - (n[b] - 1) * PS
        last = int(perm[off + n[b] - 1])
        kmin[last], kmax[last] = kc[last, :, :valid].amin(dim=1), kc[last, :, :valid].amax(dim=1)
        off += n[b]
    return dict(query=torch.randn(B, H, 1, D, device=device, generator=g, dtype=torch.float16),
                key=torch.randn(B, HKV, 1, D, device=device, generator=g, dtype=torch.float16),
                value=torch.randn(B, HKV, 1, D, device=device, generator=g, dtype=torch.float16),
                key_cache=kc, value_cache=vc, key_min=kmin, key_max=kmax, page_table=table,
                past_lens=torch.tensor(past, dtype=torch.int32, device=device),
                token_budget=torch.full((B,), budget, dtype=torch.int32, device=device))


def numpy_subcase(case, b):
    """Sequence b alone, with its pages gathered into a compact pool (numpy)."""
    past = int(case["past_lens"][b])
    n = -(-past // PS)
    ids = case["page_table"][b, :n].long()
    cpu = lambda t: t.cpu().numpy()  # noqa: E731
    return dict(query=cpu(case["query"][b: b + 1]), key=cpu(case["key"][b: b + 1]),
                value=cpu(case["value"][b: b + 1]), key_cache=cpu(case["key_cache"][ids]),
                value_cache=cpu(case["value_cache"][ids]), key_min=cpu(case["key_min"][ids]),
                key_max=cpu(case["key_max"][ids]), page_table=np.arange(n, dtype=np.int32)[None],
                past_lens=np.array([past], np.int32), token_budget=cpu(case["token_budget"][b: b + 1]))


def check_numpy(case, out, sel, b, attrs):
    sub = numpy_subcase(case, b)
    n = sub["page_table"].shape[1]
    got_out = out[b: b + 1].float().cpu().numpy()
    got_sel = sel[b: b + 1, :, :n].cpu().numpy()
    _, ref_sel = sparse_attention_ref(**sub, attrs=attrs)
    gap = selection_score_gap(sub, got_sel, ref_sel, attrs)
    if gap > 1e-3:
        raise AssertionError(f"sequence {b}: kept pages score worse than the reference's by {gap}")
    want = attention_with_selection_ref(sub, got_sel, attrs)
    np.testing.assert_allclose(got_out, want, err_msg=f"sequence {b} vs numpy", **schema.TOLERANCES["float16"])
    return gap


def check_torch_dense(torch, case, out):
    """Every sequence against fp32 attention over its gathered K/V + new token (dense budget only)."""
    B, H = case["query"].shape[:2]
    G = H // HKV
    worst = 0.0
    for b in range(B):
        past = int(case["past_lens"][b])
        ids = case["page_table"][b, : -(-past // PS)].long()
        k = case["key_cache"][ids].permute(1, 0, 2, 3).reshape(HKV, -1, D)[:, :past].float()
        v = case["value_cache"][ids].permute(1, 0, 2, 3).reshape(HKV, -1, D)[:, :past].float()
        k = torch.cat([k, case["key"][b, :, :1].float()], 1).repeat_interleave(G, 0)
        v = torch.cat([v, case["value"][b, :, :1].float()], 1).repeat_interleave(G, 0)
        q = case["query"][b, :, 0].float()  # [H, D]
        p = torch.softmax(torch.einsum("hd,htd->ht", q, k) / D ** 0.5, -1)
        ref = torch.einsum("ht,htd->hd", p, v)
        got = out[b, :, 0].float()
        tol = schema.TOLERANCES["float16"]
        err = ((got - ref).abs() - tol["rtol"] * ref.abs()).max().item()
        worst = max(worst, err)
        if err > tol["atol"]:
            raise AssertionError(f"sequence {b}: dense output off torch by {err + tol['atol']:.3g}")
    return worst


MIXED_LENS = (1000, 517, 2048, 33)


MIXED_FORMATS = (("int8", 0), ("int4", 32))  # (cold format, INT4 channels per V scale)


def check_mixed(seed, lens=MIXED_LENS, kv_heads=HKV):
    """Hot + INT8 and hot + INT4 cold pages on every sequence vs numpy; returns report rows.
    Raises on a mismatch."""
    rng = np.random.default_rng(seed)
    attrs, tol = schema.OpAttributes(), schema.TOLERANCES["float16"]
    rows = []
    for (fmt, group), (S, budget) in itertools.product(MIXED_FORMATS, ((1, 256), (1, 0), (4, 0))):
        spec = CaseSpec(lens, kv_heads * 4, kv_heads, D, PS, S, "float16", budget)
        case = make_mixed_case(spec, rng, 0.5, "channel", "token", cold_format=fmt, group_size=group)
        P = case["key_cache"].shape[0]
        what = f"mixed {fmt} S={S} budget={budget or 'dense'}"
        out, sel = sparse_attention_gpu(**case, attrs=attrs)  # poisons outputs, checks selected_pages is written
        if np.isnan(out).any():
            raise AssertionError(f"{what}: NaN left in the output")
        _, ref_sel = sparse_attention_ref(**case, attrs=attrs)
        gap = selection_score_gap(case, sel, ref_sel, attrs) if S == 1 and budget else 0.0
        if gap > 1e-3:
            raise AssertionError(f"{what}: kept pages score worse than the reference's by {gap}")
        if not (S == 1 and budget):
            np.testing.assert_array_equal(sel, ref_sel, err_msg=what)
        out64 = out.astype(np.float64)
        np.testing.assert_allclose(out64, attention_with_selection_ref(case, sel, attrs), err_msg=what, **tol)
        hot_ref = attention_with_selection_ref(dequantized_float32_case(case), sel, attrs)
        np.testing.assert_allclose(out64, hot_ref, err_msg=f"{what} vs dequantized cache", **tol)
        err = float(np.abs(out64 - hot_ref).max())
        rows.append((fmt, S, budget or "dense", P, case["key_cache_int8"].shape[0], f"{gap:.1e}", f"{err:.1e}",
                     "ok"))
        log(f"ok {what}: {P} hot + {case['key_cache_int8'].shape[0]} cold pages, max err {err:.1e}")
    return rows


SP = 4  # two-level sub-page size
TWO_LEVEL_ATTRS = schema.OpAttributes(sub_page_size=SP, candidate_share=0.5)
TWO_LEVEL_LENS = (8190, 3001, 517, 33)


def check_two_level(seed, lens=TWO_LEVEL_LENS, kv_heads=HKV, budget_sparse=1024):
    """Two-level decode on every sequence vs the numpy rule; returns report rows. Raises on a mismatch."""
    rng = np.random.default_rng(seed)
    attrs, tol = TWO_LEVEL_ATTRS, schema.TOLERANCES["float16"]
    rows = []
    for cold, budget in ((False, SP), (False, budget_sparse), (False, 0), (True, budget_sparse)):
        spec = CaseSpec(lens, kv_heads * 4, kv_heads, D, PS, 1, "float16", budget, sub_page_size=SP)
        case = make_mixed_case(spec, rng, 0.5) if cold else make_case(spec, rng)
        what = f"two-level budget={budget or 'dense'}{' hot+int8' if cold else ''}"
        call = ForwardCall(**case, attrs=attrs)
        call.launch()
        call.dev.synchronize()
        call.dev.check_flags(call.flags, what)
        out = call.output.float().cpu().numpy().astype(np.float64)
        if np.isnan(out).any():
            raise AssertionError(f"{what}: NaN left in the output")
        NP = case["page_table"].shape[1]
        got = units_mask(call.kept_units(), NP * (PS // SP))
        gap = sub_page_selection_gap(case, got, kept_sub_pages_ref(case, attrs), attrs)
        if gap > 1e-3:
            raise AssertionError(f"{what}: kept sub-pages score worse than the reference's by {gap}")
        sel = call.selected.cpu().numpy().astype(bool)
        np.testing.assert_array_equal(sel, got.reshape(*sel.shape, -1).any(-1), err_msg=f"{what} selected_pages")
        want = attention_with_selection_ref(case, got, attrs)
        np.testing.assert_allclose(out, want, err_msg=what, **tol)
        err = float(np.abs(out - want).max())
        kept = got.sum() / (len(lens) * kv_heads)
        rows.append((budget or "dense", "hot + int8" if cold else "hot", f"{kept:.0f}", f"{gap:.1e}", f"{err:.1e}",
                     "ok"))
        log(f"ok {what}: sub-pages kept/(seq, KV head) {kept:.0f}, max err {err:.1e}")
    return rows


