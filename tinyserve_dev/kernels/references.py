"""Slow numpy references for what the kernels do beyond ``ops.reference``.

* ``attention_with_selection_ref``: the op's attention for a given page
  selection, so a kernel's output can be checked even when a near-tie made it
  keep a different (equally scored) page than the float64 reference.
* ``selection_score_gap``: compares two selections by the reference's scores
  (STYLE principle 8: scores, not indices).
* ``append_kv_ref``: the cache write + metadata refresh of ``qsa_append_kv``.
* ``dequantized_float32_case``: a hot + INT8 case as the all-hot cache the kernels see.
Cases may carry the INT8 cold tier (``schema.COLD_INPUTS``): every K/V read goes
through ``ops.reference.page_keys_values``, which dequantizes cold pages with the
op's own rule, so nothing here re-implements it. None of them modifies its inputs.
"""

from __future__ import annotations

import numpy as np

from tinyserve_trt.ops import schema
from tinyserve_dev.cases import dequantized_case
from tinyserve_trt.ops.policies import get_policy, reduce_group
from tinyserve_trt.ops.reference import page_keys_values, page_min_max


def _pages(case, b):
    ps = case["key_cache"].shape[2]
    past = int(case["past_lens"][b])
    n = -(-past // ps)
    return past, n, [int(p) for p in case["page_table"][b, :n]]


def attention_with_selection_ref(case: dict, selected: np.ndarray, attrs: schema.OpAttributes | None = None):
    """Output ``[B, H, S, D]`` (float64) attending the pages ``selected [B, Hkv, NP]`` marks, plus new tokens."""
    attrs = attrs or schema.OpAttributes()
    q_all = case["query"]
    B, H, S, D = q_all.shape
    Hkv = case["key"].shape[1]
    G, ps = H // Hkv, case["key_cache"].shape[2]
    scale = schema.resolve_scale(attrs.scale, D)
    out = np.zeros((B, H, S, D))
    for b in range(B):
        past, n, pages = _pages(case, b)
        for h in range(Hkv):
            kv = [page_keys_values(p, h, case) for p in pages]
            keys = np.concatenate([k for k, _ in kv])[:past] if kv else np.zeros((0, D))
            vals = np.concatenate([v for _, v in kv])[:past] if kv else np.zeros((0, D))
            keep = np.repeat(np.asarray(selected[b, h, :n], dtype=bool), ps)[:past]
            k_all = np.concatenate([keys[keep], case["key"][b, h].astype(np.float64)])
            v_all = np.concatenate([vals[keep], case["value"][b, h].astype(np.float64)])
            t = int(keep.sum())
            for g in range(G):
                for s in range(S):
                    logits = k_all[: t + s + 1] @ q_all[b, h * G + g, s].astype(np.float64) * scale
                    p = np.exp(logits - logits.max())
                    out[b, h * G + g, s] = (p / p.sum()) @ v_all[: t + s + 1]
    return out


def dequantized_float32_case(case: dict) -> dict:
    """The all-hot equivalent of a hot + INT8 case, holding exactly what the kernels read:
    float inputs widened to float32 (exact from float16), cold pages dequantized by
    ``ops.cases.dequantized_case`` in float32, so int8 * scale is not rounded to float16
    on top (that rounding alone moves a float16 D=128 output by ~1e-3)."""
    wide = {n: a.astype(np.float32) if a.dtype.kind == "f" and n not in schema.COLD_INPUTS else a
            for n, a in case.items()}
    return dequantized_case(wide)


def group_scores_ref(case: dict, attrs: schema.OpAttributes) -> list[list[np.ndarray]]:
    """Reference page scores per (sequence, KV head) for a decode step: ``[b][h] -> [n]``."""
    policy = get_policy(attrs.policy)
    q_all = case["query"]
    B, H, _, D = q_all.shape
    Hkv = case["key"].shape[1]
    G, ps = H // Hkv, case["key_cache"].shape[2]
    scale = schema.resolve_scale(attrs.scale, D)
    result = []
    for b in range(B):
        past, n, pages = _pages(case, b)
        row = []
        for h in range(Hkv):
            kv = [page_keys_values(p, h, case) for p in pages]
            keys = np.concatenate([k for k, _ in kv])[:past] if kv else np.zeros((0, D))
            per_head = policy.score_ref(q_all[b, h * G:(h + 1) * G, 0].astype(np.float64),
                                        case["key_min"][pages, h].astype(np.float64),
                                        case["key_max"][pages, h].astype(np.float64), keys,
                                        case["key"][b, h, 0].astype(np.float64), ps, scale)
            row.append(reduce_group(per_head, attrs.group_reduce) if n else np.zeros(0))
        result.append(row)
    return result


def selection_score_gap(case: dict, got: np.ndarray, want: np.ndarray, attrs: schema.OpAttributes) -> float:
    """Largest difference between the sorted reference scores of two selections.

    0 when they keep the same pages; small when a near-tie was broken the other
    way; large when a kernel kept a worse page. Raises if the counts differ.
    """
    scores = group_scores_ref(case, attrs)
    gap = 0.0
    for b, row in enumerate(scores):
        for h, sc in enumerate(row):
            n = sc.shape[0]
            g, w = np.asarray(got[b, h, :n], bool), np.asarray(want[b, h, :n], bool)
            if g.sum() != w.sum():
                raise AssertionError(f"sequence {b} KV head {h}: kept {g.sum()} pages, reference {w.sum()}")
            if np.any(got[b, h, n:]):
                raise AssertionError(f"sequence {b} KV head {h}: padding columns marked selected")
            if n:
                gap = max(gap, float(np.max(np.abs(np.sort(sc[g]) - np.sort(sc[w])), initial=0.0)))
    return gap


def append_kv_ref(key, value, key_cache, value_cache, key_min, key_max, page_table, past_lens):
    """Return copies of ``(key_cache, value_cache, key_min, key_max)`` after writing the
    ``S`` new tokens at slots ``past_lens[b] + i`` and recomputing touched pages' metadata."""
    kc, vc, kmin, kmax = (a.copy() for a in (key_cache, value_cache, key_min, key_max))
    B, Hkv, S, _ = key.shape
    ps = kc.shape[2]
    for b in range(B):
        past = int(past_lens[b])
        for i in range(S):
            page = int(page_table[b, (past + i) // ps])
            kc[page, :, (past + i) % ps] = key[b, :, i]
            vc[page, :, (past + i) % ps] = value[b, :, i]
        end = past + S
        for lp in range(past // ps, -(-end // ps)):
            page = int(page_table[b, lp])
            for h in range(Hkv):
                kmin[page, h], kmax[page, h] = page_min_max(kc[page, h], min(ps, end - lp * ps))
    return kc, vc, kmin, kmax
