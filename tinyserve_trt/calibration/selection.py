"""Replay the op's decode-step page selection on captured queries and keys.

For a source whose graph does not contain the op (the HF model), position
``t`` is treated as a decode step over a cache of tokens ``[0, t)``: page
metadata from those keys, then ``score_ref`` -> ``reduce_group`` ->
``select_pages``, the functions the numpy reference of the op uses, so the
selections are the op's.
"""

from __future__ import annotations

import numpy as np

from tinyserve_trt.ops import schema
from tinyserve_trt.ops.policies import get_policy, reduce_group, select_pages


def replay_selection(queries: np.ndarray, keys: np.ndarray, positions, page_size: int, token_budget: int,
                     attrs: schema.OpAttributes) -> np.ndarray:
    """``[steps, L, Hkv, NP]`` bool selections at decode ``positions``.

    queries: ``[L, H, T, D]`` after rotary; keys: ``[L, Hkv, T, D]``; NP covers the last step.
    """
    L, H, T, D = queries.shape
    Hkv = keys.shape[1]
    G = H // Hkv
    positions = [int(t) for t in positions]
    if not positions or min(positions) < 1 or max(positions) >= T:
        raise ValueError(f"decode positions must lie in [1, {T})")
    policy = get_policy(attrs.policy)
    scale = schema.resolve_scale(attrs.scale, D)
    NP = -(-max(positions) // page_size)
    out = np.zeros((len(positions), L, Hkv, NP), bool)
    for i, t in enumerate(positions):
        n = -(-t // page_size)
        pad = n * page_size - t
        for layer in range(L):
            k = keys[layer, :, :t].astype(np.float64)  # [Hkv, t, D]
            kp = np.concatenate([k, np.repeat(k[:, -1:], pad, axis=1)], axis=1).reshape(Hkv, n, page_size, D)
            kmin, kmax = kp.min(axis=2), kp.max(axis=2)  # padding repeats a valid key: min/max unchanged
            for h in range(Hkv):
                q = queries[layer, h * G:(h + 1) * G, t].astype(np.float64)
                if policy.selects:
                    per_head = policy.score_ref(q, kmin[h], kmax[h], k[h], keys[layer, h, t].astype(np.float64),
                                                page_size, scale)
                    keep = select_pages(reduce_group(per_head, attrs.group_reduce), token_budget, page_size,
                                        attrs.sink_pages, attrs.recent_pages)
                else:
                    keep = np.ones(n, bool)
                out[i, layer, h, :n] = keep
    return out
