"""Replay the op's decode-step page selection on captured queries and keys.

For a source whose graph does not contain the op (the HF model), position
``t`` is treated as a decode step over a cache of tokens ``[0, t)``: page
metadata from those keys as a page pool writes it (``key_min/key_max``, and
for a two-level ``attrs`` the 4-bit ``key_sub_bounds`` of ``fine_bounds``),
then ``reference.group_keeps`` (``decode_keep`` per group or query head) - the numpy reference op's own selection rule,
two-level included - so the selections are the op's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tinyserve_trt.contracts.dense_layers import dense_layer_indices
from tinyserve_trt.ops import schema
from tinyserve_trt.ops.fine_bounds import pages_sub_bounds
from tinyserve_trt.ops.reference import group_keeps


def replay_selection(queries: np.ndarray, keys: np.ndarray, positions, page_size: int, token_budget: int,
                     attrs: schema.OpAttributes, dense_layers: int | Sequence[int] = 0) -> np.ndarray:
    """``[steps, L, Hkv, NP]`` bool selections at decode ``positions``.

    queries: ``[L, H, T, D]`` after rotary; keys: ``[L, Hkv, T, D]``; NP covers the last step.
    ``attrs``: the sparse layers' op attributes (``sub_page_size`` not 0 or ``page_size``: two-level;
    a page is selected when any of its sub-pages is); ``dense_layers`` (the leading count, or
    indices: ``contracts.dense_layers``) run the dense policy, as an exported package's do (every
    page selected).
    """
    L, H, T, D = queries.shape
    Hkv = keys.shape[1]
    G = H // Hkv
    positions = [int(t) for t in positions]
    if not positions or min(positions) < 1 or max(positions) >= T:
        raise ValueError(f"decode positions must lie in [1, {T})")
    ps = page_size
    two_level = attrs.sub_page_size not in (0, ps)
    if two_level and ps % attrs.sub_page_size:
        raise ValueError(f"sub_page_size {attrs.sub_page_size} must divide the page size {ps}")
    r = ps // attrs.sub_page_size if two_level else 1
    scale = schema.resolve_scale(attrs.scale, D)
    NP = -(-max(positions) // ps)
    dense = dense_layer_indices(dense_layers, L)
    out = np.zeros((len(positions), L, Hkv, NP), bool)
    for i, t in enumerate(positions):
        n = -(-t // ps)
        pad = n * ps - t
        for layer in range(L):
            if layer in dense:
                out[i, layer, :, :n] = True
                continue
            k = keys[layer, :, :t]  # [Hkv, t, D]
            kp = np.concatenate([k, np.repeat(k[:, -1:], pad, axis=1)], axis=1).reshape(Hkv, n, ps, D)
            kmin, kmax = kp.min(axis=2), kp.max(axis=2)  # padding repeats a valid key: min/max unchanged
            codes = None
            if two_level:  # [n, Hkv, r, D], the pages' written tokens only
                codes = pages_sub_bounds(np.swapaxes(kp, 0, 1), attrs.sub_page_size, np.swapaxes(kmin, 0, 1),
                                         np.swapaxes(kmax, 0, 1), np.minimum(ps, t - np.arange(n) * ps))
            for h in range(Hkv):
                keep = group_keeps(queries[layer, h * G:(h + 1) * G, t], kmin[h], kmax[h], k[h], keys[layer, h, t],
                                   t, token_budget, ps, attrs, scale, None if codes is None else codes[:, h])
                out[i, layer, h, :n] = keep.reshape(len(keep), n, r).any(axis=(0, 2))  # group_reduce head: union
    return out
