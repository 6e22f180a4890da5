"""Scales of cold KV pages: granularities, the scale of a group, calibrated (static) scales.

The cold formats themselves - quantize, dequantize, packing - are ``ops/cold_codec.py``'s
alone; this module holds the scale rules it reads. The scale of a group is
``absmax / qmax`` (1 for an all-zero group), raised to the scale dtype's smallest normal
number when it would fall below it (``group_scale``: ``1e-44 / 127`` underflows to 0 or a
denormal, and ``x / scale`` to inf/NaN), so ``|x - x'| <= scale / 2`` elementwise for the
quantized (valid) tokens.

Granularity = which axes one scale covers, per (page, KV head) (``scale_shape``; INT4
values also split the channels into groups of ``group_size``):

  ``head``     one scale per page and head             scale ``[Hkv, 1, 1]``
  ``channel``  one per channel (over the page's tokens) scale ``[Hkv, 1, D]``
  ``token``    one per token (over its channels)        scale ``[Hkv, ps, 1]``

KIVI (Liu et al., 2024) quantizes K per channel (keys have outlier channels)
and V per token; ``benchmarks/quant_granularity.py`` measures the choice on
SmolLM2 (``benchmarks/results/quant_granularity.md``). Does not modify its inputs.

Scales are dynamic (each page's own absmax) by default; ``static_page_scale`` /
``layer_page_scales`` shape calibrated ranges instead (``tinyserve-calibrate`` records
them; ``ColdCodec.quantize(scale=...)`` applies them), which clip what falls outside.
"""

from __future__ import annotations

import numpy as np

from .array_ns import namespace

GRANULARITIES = ("head", "channel", "token")
QMAX = 127  # symmetric: -128 is never produced, so negation is exact


def group_scale(amax, qmax: int, dtype=np.float32):
    """Scales ``absmax / qmax`` of groups with absolute maxima ``amax`` (>= 0), as ``dtype``:
    1 for an all-zero group, otherwise clamped to ``dtype``'s normal range, so a scale is
    never 0, a denormal or inf. Raising a tiny scale keeps ``|x| <= qmax * scale`` (no clip):
    the bound ``|x - q * scale| <= scale / 2`` holds for it; the top clamp only bites for
    values past ``qmax * finfo(dtype).max``. numpy arrays or torch tensors (math in float64)."""
    info = np.finfo(dtype)
    xp = namespace(amax)
    amax = xp.astype(amax, np.float64)
    return xp.astype(xp.where(amax > 0, xp.clip(amax / qmax, float(info.tiny), float(info.max)), 1.0), dtype)


def scale_shape(granularity: str, num_kv_heads: int, page_size: int, head_dim: int,
                group_size: int = 0) -> tuple[int, int, int]:
    """Shape of one page's scales ``[Hkv, ps|1, C]``: ``C = D`` per channel, else ``D / group_size``
    groups of channels (``group_size`` 0: one group, ``C = 1``); ``ps`` rows per token, else 1.
    Channel ``c`` reads column ``c // (D / C)`` (``cold_codec.expand_scale``)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    group = group_size or head_dim
    if head_dim % group:
        raise ValueError(f"group_size {group} must divide the head dim {head_dim}")
    return (num_kv_heads, page_size if granularity == "token" else 1,
            head_dim if granularity == "channel" else head_dim // group)


def static_page_scale(static: np.ndarray, granularity: str, page_size: int) -> np.ndarray:
    """A calibrated scale ``[Hkv, 1|ps, D|1]`` (e.g. per channel ``[Hkv, 1, D]``, per head
    ``[Hkv, 1, 1]``) as one page's scale of ``granularity``: the max over the axes that
    granularity does not split (a wider scale never clips more), broadcast to its shape."""
    static = np.asarray(static, np.float32)
    if static.ndim != 3 or static.shape[1] not in (1, page_size):
        raise ValueError(f"a static scale is [Hkv, 1|ps, D|1], got shape {static.shape}")
    hkv, d = static.shape[0], static.shape[2]
    target = scale_shape(granularity, hkv, page_size, d)
    axes = tuple(a for a in (1, 2) if target[a] == 1 and static.shape[a] != 1)
    reduced = static.max(axis=axes, keepdims=True) if axes else static
    return np.ascontiguousarray(np.broadcast_to(reduced, target), np.float32)


def layer_page_scales(static: np.ndarray, granularity: str, num_layers: int, num_kv_heads: int, page_size: int,
                      head_dim: int) -> np.ndarray:
    """:func:`static_page_scale` of every layer: ``static [L, Hkv, 1|ps, 1|D]`` (positive) ->
    ``[L, Hkv, ps|1, D|1]``. ValueError naming the expected shape otherwise."""
    static = np.asarray(static, np.float32)
    if static.ndim != 4 or static.shape[:2] != (num_layers, num_kv_heads) or \
            static.shape[3] not in (1, head_dim) or not np.all(static > 0):
        raise ValueError(f"static scales must be positive [L={num_layers}, Hkv={num_kv_heads}, 1|ps, 1|D={head_dim}], "
                         f"got shape {static.shape}")
    return np.stack([static_page_scale(a, granularity, page_size) for a in static])
