"""Slow numpy references for what the kernels do beyond ``ops.reference``.

* ``attention_with_selection_ref``: the op's attention for a given page (or,
  two-level, sub-page) selection, so a kernel's output can be checked even when
  a near-tie made it keep a different (equally scored) page than the float64 reference.
* ``two_level_scores_ref`` / ``kept_sub_pages_ref`` / ``sub_page_selection_gap``:
  the two-level rule's scores and kept sub-pages (``ops.two_level``) per (sequence,
  KV head), and the comparison of two sub-page selections by those scores.
* ``selection_score_gap``: compares two selections by the reference's scores
  (STYLE principle 8: scores, not indices).
* ``append_kv_ref``: the cache write + metadata refresh of ``qsa_append_kv``.
* ``per_query_head_case`` / ``group_union``: ``group_reduce="head"`` as the shared rule with
  groups of one, so the checks above apply per query head.
Cases may carry the INT8 cold tier (``schema.COLD_INPUTS``): every K/V read goes
through ``ops.reference.page_keys_values``, which dequantizes cold pages with the
op's own rule, so nothing here re-implements it. None of them modifies its inputs.
"""

from __future__ import annotations

import numpy as np

from tinyserve_trt.ops import fine_bounds, schema
from tinyserve_trt.ops.policies import get_policy, reduce_group
from tinyserve_trt.ops.reference import page_keys_values, page_min_max
from tinyserve_trt.ops.two_level import select_sub_pages


def _pages(case, b):
    ps = case["key_cache"].shape[2]
    past = int(case["past_lens"][b])
    n = -(-past // ps)
    return past, n, [int(p) for p in case["page_table"][b, :n]]


def attention_with_selection_ref(case: dict, selected: np.ndarray, attrs: schema.OpAttributes | None = None):
    """Output ``[B, H, S, D]`` (float64) attending what ``selected`` marks, plus new tokens.

    ``selected [B, Hkv, NP * r]``: units of ``ps / r`` tokens, logical page ``i // r``'s
    sub-page ``i % r`` (r = 1: the ``selected_pages`` layout)."""
    attrs = attrs or schema.OpAttributes()
    q_all = case["query"]
    B, H, S, D = q_all.shape
    Hkv = case["key"].shape[1]
    G = H // Hkv
    r = selected.shape[2] // case["page_table"].shape[1]
    ps = case["key_cache"].shape[2] // r  # tokens per unit
    scale = schema.resolve_scale(attrs.scale, D)
    out = np.zeros((B, H, S, D))
    for b in range(B):
        past, n, pages = _pages(case, b)
        for h in range(Hkv):
            kv = [page_keys_values(p, h, case) for p in pages]
            keys = np.concatenate([k for k, _ in kv])[:past] if kv else np.zeros((0, D))
            vals = np.concatenate([v for _, v in kv])[:past] if kv else np.zeros((0, D))
            keep = np.repeat(np.asarray(selected[b, h, :n * r], dtype=bool), ps)[:past]
            k_all = np.concatenate([keys[keep], case["key"][b, h].astype(np.float64)])
            v_all = np.concatenate([vals[keep], case["value"][b, h].astype(np.float64)])
            t = int(keep.sum())
            for g in range(G):
                for s in range(S):
                    logits = k_all[: t + s + 1] @ q_all[b, h * G + g, s].astype(np.float64) * scale
                    p = np.exp(logits - logits.max())
                    out[b, h * G + g, s] = (p / p.sum()) @ v_all[: t + s + 1]
    return out


# Inputs with a KV-head axis at 1 (schema layouts): [B, Hkv, S, D], [P, Hkv, ps, D], [Ptot, Hkv, D],
# [Ptot, Hkv, r, D], and the cold tier's [Pcold, Hkv, ...] pools and scales.
_PER_KV_HEAD = ("key", "value", "key_cache", "value_cache", "key_min", "key_max", "key_sub_bounds",
                *schema.COLD_INPUTS)


def per_query_head_case(case: dict) -> dict:
    """``case`` with each KV head's pages repeated for its ``G = H / Hkv`` query heads (every input
    with a KV-head axis, ``[.., Hkv, ..] -> [.., H, ..]``: query head ``hq`` reads KV head
    ``hq // G``'s K/V, bounds, codes and cold pages), so ``Hkv = H``. A shared selection
    (``group_reduce`` max or sum) with groups of one on it IS ``group_reduce="head"`` on ``case``:
    the same kept units ``[B, H, NP * r]`` per query head, the same output, and its
    ``selected_pages [B, H, NP]`` under :func:`group_union` the head rule's. Does not modify ``case``."""
    G = case["query"].shape[1] // case["key"].shape[1]
    return {n: np.repeat(a, G, axis=1) if n in _PER_KV_HEAD and a is not None else a for n, a in case.items()}


def group_union(mask: np.ndarray, num_kv_heads: int, r: int = 1) -> np.ndarray:
    """Per-query-head kept units ``[B, H, NP * r]`` as the op's ``selected_pages [B, Hkv, NP]``: a
    page any sub-page of which any query head of the KV head's group keeps."""
    B, H, width = mask.shape
    return np.asarray(mask, bool).reshape(B, num_kv_heads, H // num_kv_heads, width // r, r).any(axis=(2, 4))


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


def two_level_scores_ref(case: dict, attrs: schema.OpAttributes) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Decode-step scores per (sequence, KV head): ``[b][h] -> (coarse [n], fine [n * r])``
    (float64), the page bound and each sub-page's bound from ``key_sub_bounds`` decoded by
    ``fine_bounds.decode``, combined over the group, as ``ops/reference.py`` computes them."""
    policy = get_policy(attrs.policy)
    q_all = case["query"]
    B, H, _, D = q_all.shape
    Hkv = case["key"].shape[1]
    G, ps = H // Hkv, case["key_cache"].shape[2]
    sp = attrs.sub_page_size
    scale = schema.resolve_scale(attrs.scale, D)
    coarse = group_scores_ref(case, attrs)
    result = []
    for b in range(B):
        past, n, pages = _pages(case, b)
        row = []
        for h in range(Hkv):
            q = q_all[b, h * G:(h + 1) * G, 0].astype(np.float64)
            lo, hi = fine_bounds.decode(case["key_sub_bounds"][pages, h], case["key_min"][pages, h],
                                        case["key_max"][pages, h])
            fine = policy.score_ref(q, lo.reshape(-1, D).astype(np.float64), hi.reshape(-1, D).astype(np.float64),
                                    None, None, sp, scale) if n else np.zeros((G, 0))
            row.append((coarse[b][h], reduce_group(fine, attrs.group_reduce) if n else np.zeros(0)))
        result.append(row)
    return result


def kept_sub_pages_ref(case: dict, attrs: schema.OpAttributes) -> np.ndarray:
    """Kept sub-pages ``[B, Hkv, NP * r]`` (bool) of a two-level decode step (``ops.two_level``)."""
    ps, NP = case["key_cache"].shape[2], case["page_table"].shape[1]
    sp = attrs.sub_page_size
    r = ps // sp
    B, Hkv = case["key"].shape[:2]
    keep = np.zeros((B, Hkv, NP * r), dtype=bool)
    for b, row in enumerate(two_level_scores_ref(case, attrs)):
        past = int(case["past_lens"][b])
        for h, (coarse, fine) in enumerate(row):
            n = coarse.shape[0]
            keep[b, h, : n * r] = select_sub_pages(coarse, fine, past, int(case["token_budget"][b]), ps, sp,
                                                   attrs.candidate_share, attrs.sink_pages, attrs.recent_pages)
    return keep


def units_mask(units: list[list[np.ndarray]], width: int) -> np.ndarray:
    """A kernel's kept list (``ForwardCall.kept_units``) as a bool ``[B, Hkv, width]`` mask."""
    B, Hkv = len(units), len(units[0]) if units else 0
    mask = np.zeros((B, Hkv, width), dtype=bool)
    for b in range(B):
        for h in range(Hkv):
            u = np.asarray(units[b][h])
            if u.size and (np.any(np.diff(u) <= 0) or u.min() < 0 or u.max() >= width):
                raise AssertionError(f"sequence {b} KV head {h}: kept list not ascending in [0, {width}): {u}")
            mask[b, h, u] = True
    return mask


def sub_page_selection_gap(case: dict, got: np.ndarray, want: np.ndarray, attrs: schema.OpAttributes) -> float:
    """Largest difference between the sorted reference sub-page scores of two two-level
    selections ``[B, Hkv, NP * r]``; raises if their counts differ or padding is marked."""
    r = case["key_cache"].shape[2] // attrs.sub_page_size
    gap = 0.0
    for b, row in enumerate(two_level_scores_ref(case, attrs)):
        for h, (_, fine) in enumerate(row):
            m = fine.shape[0]
            g, w = np.asarray(got[b, h, :m], bool), np.asarray(want[b, h, :m], bool)
            if g.sum() != w.sum():
                raise AssertionError(f"sequence {b} KV head {h}: kept {g.sum()} sub-pages, reference {w.sum()} "
                                     f"(r={r})")
            if np.any(got[b, h, m:]):
                raise AssertionError(f"sequence {b} KV head {h}: sub-pages past the sequence marked kept")
            if m:
                gap = max(gap, float(np.max(np.abs(np.sort(fine[g]) - np.sort(fine[w])), initial=0.0)))
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
