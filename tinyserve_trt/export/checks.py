"""Numeric checks of matched attention blocks, read off probe runs of the source.

A mask must be exactly the causal mask (with an all-ones attention_mask):
anything else - a sliding window, ALiBi or another position bias, a
bidirectional prefix - is a different function and is refused, naming the node.
"""

from __future__ import annotations

import numpy as np

from .rules.base import AttentionMatch, Refusal


def causal_visible(past: int, seq: int) -> np.ndarray:
    """[S, P+S]: new token s sees cached/new position t iff t <= past + s."""
    return np.arange(past + seq)[None, :] <= past + np.arange(seq)[:, None]


def check_masks(match: AttentionMatch, values: dict, past: int, seq: int) -> None:
    vis = causal_visible(past, seq)
    for mask in match.masks:
        arr = np.asarray(values[mask.value.name])
        try:
            arr = np.broadcast_to(arr, arr.shape[:-2] + vis.shape) if arr.ndim >= 2 else arr
        except ValueError:
            raise Refusal(mask.node, f"attention mask of shape {arr.shape} does not cover [S={seq}, T={past + seq}]")
        if mask.kind == "add":
            keeps = arr == 0
            drops = arr <= -1e4
            if not np.all(keeps[..., vis]):
                if np.all(drops[..., vis] | keeps[..., vis]):
                    raise Refusal(mask.node, f"the mask hides positions a causal mask keeps at context "
                                             f"{past + seq} (a sliding window?)")
                raise Refusal(mask.node, "an additive bias on visible positions (ALiBi or a relative position "
                                         "bias) is not implemented by the op")
            if not np.all(drops[..., ~vis]):
                raise Refusal(mask.node, "the mask lets tokens see the future (not causal)")
        else:  # "where": keep where cond == keep_when; "bool": True = attend
            keep = (arr.astype(bool) == mask.keep_when) if mask.kind == "where" else arr.astype(bool)
            if not np.all(keep[..., vis]):
                raise Refusal(mask.node, f"the mask hides positions a causal mask keeps at context "
                                         f"{past + seq} (a sliding window?)")
            if np.any(keep[..., ~vis]):
                raise Refusal(mask.node, "the mask lets tokens see the future (not causal)")


def resolve_scale(match: AttentionMatch, values: dict) -> float:
    """The softmax scale of the block: the Attention op's attribute, or the
    product of the scalar multipliers on q, K and the logits (constants or
    shape-derived values read from the probe); 0.0 = the op's 1/sqrt(D)."""
    if match.rule == "onnx_attention":
        return match.fixed_scale or 0.0
    scale = 1.0
    for node, value, divides in match.scale_factors:
        v = float(np.asarray(values[value.name]).reshape(-1)[0])
        scale = scale / v if divides else scale * v
    return scale
