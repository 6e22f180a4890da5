"""Numpy reference of QueryAwareSparseAttention: slow, loop-per-head, obviously correct.

Tests of every other implementation (ONNX function, CUDA kernels, TensorRT
plugin) compare against this; calibration and benchmarks use it too.
Computes in float64 and returns the dtype of ``query``. Does not modify the cache.
"""

from __future__ import annotations

import numpy as np

from . import fine_bounds, schema
from .cold_codec import ColdCodec
from .policies import get_policy, reduce_group, select_pages
from .two_level import select_sub_pages


def page_keys_values(page_id: int, kv_head: int, caches: dict) -> tuple[np.ndarray, np.ndarray]:
    """K and V ``[ps, D]`` (float64) of one physical page, dequantizing cold pages.

    Page ids below the hot pool size are hot; the rest index the cold pools, INT8
    or - uint8 pools - packed INT4 (``cold_codec``: the format is the pools' dtype; INT4 keys
    read the page's ``key_min``/``key_max``, which ``caches`` must then hold, and in a two-level
    call its ``key_sub_bounds``: keys on the sub-page bounds).
    """
    hot = caches["key_cache"].shape[0]
    if page_id < hot:
        return (caches["key_cache"][page_id, kv_head].astype(np.float64),
                caches["value_cache"][page_id, kv_head].astype(np.float64))
    if caches.get("key_cache_int8") is None:
        raise ValueError(f"page id {page_id} is past the hot pool ({hot} pages) and no cold pool was given")
    c = page_id - hot
    codec = ColdCodec("int4" if caches["key_cache_int8"].dtype == np.uint8 else "int8")
    codes = caches.get("key_sub_bounds")
    keys = codec.dequantize_keys(caches["key_cache_int8"][c, kv_head], caches["key_scale"][c, kv_head],
                                 caches["key_min"][page_id, kv_head], caches["key_max"][page_id, kv_head], np.float64,
                                 sub_codes=None if codes is None else codes[page_id, kv_head])
    return keys, codec.dequantize(caches["value_cache_int8"][c, kv_head], caches["value_scale"][c, kv_head], np.float64)


def sparse_attention_ref(query, key, value, key_cache, value_cache, key_min, key_max, page_table, past_lens,
                         token_budget, key_cache_int8=None, value_cache_int8=None, key_scale=None,
                         value_scale=None, key_sub_bounds=None, *, attrs: schema.OpAttributes | None = None):
    """Return ``(output [B, H, S, D], selected_pages [B, Hkv, NP] bool)``. Inputs as in ``schema.INPUTS``.

    ``group_reduce="head"``: each query head attends the units it selects alone; ``selected_pages``
    marks a page any head of the group attends.

    Two-level (``attrs.sub_page_size`` not 0 or ps): ``selected_pages`` marks a
    page when any of its sub-pages is attended."""
    attrs = attrs or schema.OpAttributes()
    get_policy(attrs.policy)  # an unregistered policy fails before any work
    B, H, S, D = query.shape
    Hkv = key.shape[1]
    if H % Hkv:
        raise ValueError(f"query heads {H} not a multiple of KV heads {Hkv}")
    G = H // Hkv
    ps = key_cache.shape[2]
    NP = page_table.shape[1]
    scale = schema.resolve_scale(attrs.scale, D)
    sp = attrs.sub_page_size if attrs.sub_page_size not in (0, ps) else ps
    if sp != ps:
        if ps % sp:
            raise ValueError(f"sub_page_size {sp} must divide the page size {ps}")
        if key_sub_bounds is None or key_sub_bounds.shape[2] != ps // sp:
            raise ValueError(f"two-level selection needs key_sub_bounds [Ptot, Hkv, {ps // sp}, D]")
    caches = dict(key_cache=key_cache, value_cache=value_cache, key_min=key_min, key_max=key_max,
                  key_cache_int8=key_cache_int8,
                  value_cache_int8=value_cache_int8, key_scale=key_scale, value_scale=value_scale,
                  key_sub_bounds=key_sub_bounds if sp != ps else None)  # INT4 keys: on the sub-page bounds
    out = np.zeros((B, H, S, D), dtype=np.float64)
    selected = np.zeros((B, Hkv, NP), dtype=bool)
    for b in range(B):
        past = int(past_lens[b])
        n = -(-past // ps)
        if n > NP:
            raise ValueError(f"sequence {b}: {past} cached tokens need {n} pages, page table has {NP}")
        pages = [int(p) for p in page_table[b, :n]]
        for h in range(Hkv):
            kv = [page_keys_values(p, h, caches) for p in pages]
            keys = np.concatenate([k for k, _ in kv])[:past] if kv else np.zeros((0, D))
            vals = np.concatenate([v for _, v in kv])[:past] if kv else np.zeros((0, D))
            q = query[b, h * G:(h + 1) * G].astype(np.float64)  # [G, S, D]
            if S == 1:
                keeps = group_keeps(q[:, 0], key_min[pages, h], key_max[pages, h], keys, key[b, h, 0], past,
                                    int(token_budget[b]), ps, attrs, scale,
                                    None if sp == ps else key_sub_bounds[pages, h])
            else:
                keeps = np.ones((1, n * (ps // sp)), dtype=bool)
            selected[b, h, :n] = keeps.reshape(len(keeps), n, ps // sp).any(axis=(0, 2))
            for g in range(G):
                tok_keep = np.repeat(keeps[g % len(keeps)], sp)[:past]  # one row per query head, or shared
                k_all = np.concatenate([keys[tok_keep], key[b, h].astype(np.float64)])  # [T + S, D]
                v_all = np.concatenate([vals[tok_keep], value[b, h].astype(np.float64)])
                t = int(tok_keep.sum())
                for s in range(S):
                    visible = t + s + 1  # cached kept tokens, then new tokens up to and including s
                    logits = k_all[:visible] @ q[g, s] * scale
                    p = np.exp(logits - logits.max())
                    out[b, h * G + g, s] = (p / p.sum()) @ v_all[:visible]
    return out.astype(query.dtype), selected


def group_keeps(q, page_min, page_max, keys, new_key, past: int, budget: int, page_size: int,
                attrs: schema.OpAttributes, scale: float, sub_codes=None) -> np.ndarray:
    """The decode-step selections of one sequence and KV head ``[1 | G, n * r]`` (bool): one row
    shared by the group's ``G`` query heads (``q [G, D]``), or with ``group_reduce="head"`` one per
    query head, each :func:`decode_keep` of that head alone. Arguments as in :func:`decode_keep`."""
    if attrs.group_reduce != "head":
        return decode_keep(q, page_min, page_max, keys, new_key, past, budget, page_size, attrs, scale, sub_codes)[None]
    return np.stack([decode_keep(q[g:g + 1], page_min, page_max, keys, new_key, past, budget, page_size, attrs, scale,
                                 sub_codes) for g in range(q.shape[0])])


def decode_keep(q, page_min, page_max, keys, new_key, past: int, budget: int, page_size: int,
                attrs: schema.OpAttributes, scale: float, sub_codes=None) -> np.ndarray:
    """The op's decode-step selection for one sequence and KV head: kept units ``[n * r]`` (bool;
    pages, or with ``sub_codes`` sub-pages of ``attrs.sub_page_size`` tokens, ``r = ps / sp``).

    q: ``[G, D]`` the group's queries (``group_reduce="head"``: one head's, ``[1, D]``;
    :func:`group_keeps` makes a row per head); page_min/page_max: ``[n, D]`` the pages' ``key_min/key_max``;
    keys: ``[past, D]`` the cached keys the op attends (dequantized); new_key: ``[D]``; sub_codes:
    ``[n, r, D]`` the pages' ``key_sub_bounds`` (None: single level). The one definition: the
    reference and calibration's replay (``calibration/selection.py``) call it. Does not modify inputs.
    """
    policy = get_policy(attrs.policy)
    n = page_min.shape[0]
    sp = page_size if sub_codes is None else attrs.sub_page_size
    if not policy.selects or n == 0:
        return np.ones(n * (page_size // sp), dtype=bool)
    q, keys, new_key = q.astype(np.float64), keys.astype(np.float64), new_key.astype(np.float64)
    per_head = policy.score_ref(q, page_min.astype(np.float64), page_max.astype(np.float64), keys, new_key,
                                page_size, scale)
    coarse = reduce_group(per_head, attrs.group_reduce)
    if sub_codes is None:
        return select_pages(coarse, budget, page_size, attrs.sink_pages, attrs.recent_pages)
    D = page_min.shape[-1]
    lo, hi = fine_bounds.decode(sub_codes, page_min, page_max)
    fine = reduce_group(policy.score_ref(q, lo.reshape(-1, D).astype(np.float64), hi.reshape(-1, D).astype(np.float64),
                                         keys, new_key, sp, scale), attrs.group_reduce)
    return select_sub_pages(coarse, fine, past, budget, page_size, sp, attrs.candidate_share, attrs.sink_pages,
                            attrs.recent_pages)


def page_min_max(keys: np.ndarray, valid: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Metadata of one page: elementwise min and max over its first ``valid`` keys ``[ps, D]``."""
    k = keys[: keys.shape[0] if valid is None else valid]
    return k.min(axis=0), k.max(axis=0)
