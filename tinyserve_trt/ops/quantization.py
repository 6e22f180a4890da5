"""Symmetric INT8 quantization of KV pages: the reference every cold-page path uses.

A cold page stores ``q = clip(round(x / scale), -127, 127)`` as int8 and a float32
``scale`` broadcast over the page; the op dequantizes ``x' = q * scale``
(``schema.INPUTS`` ``key_scale`` / ``value_scale``: ``[Pcold, Hkv, ps|1, D|1]``).
The scale of a group is ``absmax / 127`` (1 for an all-zero group), raised to
float32's smallest normal number when it would fall below it (``group_scale``:
``1e-44 / 127`` underflows to 0 or a denormal, and ``x / scale`` to inf/NaN), so
``|x - x'| <= scale / 2`` elementwise for the quantized (valid) tokens.

Granularity = which axes one scale covers, per (page, KV head):

  ``head``     one scale per page and head             scale ``[Hkv, 1, 1]``
  ``channel``  one per channel (over the page's tokens) scale ``[Hkv, 1, D]``
  ``token``    one per token (over its channels)        scale ``[Hkv, ps, 1]``

KIVI (Liu et al., 2024) quantizes K per channel (keys have outlier channels)
and V per token; ``benchmarks/quant_granularity.py`` measures the choice on
SmolLM2 (``benchmarks/results/quant_granularity.md``). Pure numpy; does not
modify its inputs.

Scales are dynamic (each page's own absmax) by default; ``static_page_scale`` /
``quantize_page_static`` use calibrated ranges instead (``tinyserve-calibrate``
records them), which clip what falls outside.
"""

from __future__ import annotations

import numpy as np

GRANULARITIES = ("head", "channel", "token")
QMAX = 127  # symmetric: -128 is never produced, so negation is exact


def group_scale(amax: np.ndarray, qmax: int, dtype=np.float32) -> np.ndarray:
    """Scales ``absmax / qmax`` of groups with absolute maxima ``amax`` (>= 0), as ``dtype``:
    1 for an all-zero group, otherwise clamped to ``dtype``'s normal range, so a scale is
    never 0, a denormal or inf. Raising a tiny scale keeps ``|x| <= qmax * scale`` (no clip):
    the bound ``|x - q * scale| <= scale / 2`` holds for it; the top clamp only bites for
    values past ``qmax * finfo(dtype).max``."""
    info = np.finfo(dtype)
    amax = np.asarray(amax, np.float64)
    return np.where(amax > 0, np.clip(amax / qmax, float(info.tiny), float(info.max)), 1.0).astype(dtype)


def scale_shape(granularity: str, num_kv_heads: int, page_size: int, head_dim: int) -> tuple[int, int, int]:
    """Shape of one page's scale: ``[Hkv, ps|1, D|1]``."""
    if granularity == "head":
        return (num_kv_heads, 1, 1)
    if granularity == "channel":
        return (num_kv_heads, 1, head_dim)
    if granularity == "token":
        return (num_kv_heads, page_size, 1)
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def _reduce_axes(granularity: str) -> tuple[int, ...]:
    # axes of one page [Hkv, ps, D] that one scale spans
    return {"head": (1, 2), "channel": (1,), "token": (2,)}[granularity]


def quantize_page(x: np.ndarray, granularity: str, valid: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Quantize one page ``x [Hkv, ps, D]`` -> ``(q int8 [Hkv, ps, D], scale float32 [Hkv, ps|1, D|1])``.

    Scales come from the first ``valid`` tokens only (a partial page's tail is
    garbage that must not widen them); the tail is quantized with clipping.
    """
    if x.ndim != 3:
        raise ValueError(f"a page is [Hkv, ps, D], got shape {x.shape}")
    Hkv, ps, D = x.shape
    scale_shape(granularity, Hkv, ps, D)  # validates the name
    valid = ps if valid is None else int(valid)
    if not 0 <= valid <= ps:
        raise ValueError(f"valid must be in [0, {ps}], got {valid}")
    xf = x.astype(np.float64)
    absx = np.abs(xf)
    absx[:, valid:, :] = 0.0
    amax = absx.max(axis=_reduce_axes(granularity), keepdims=True)
    scale = group_scale(amax, QMAX)
    # divide by the float32 scale actually stored, so the error bound holds for it
    q = np.clip(np.rint(xf / scale.astype(np.float64)), -QMAX, QMAX).astype(np.int8)
    return q, scale


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


def quantize_page_static(x: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a page with a fixed (calibrated) ``scale`` of its shape: values past
    ``127 * scale`` clip, so ``|x - x'| <= scale / 2`` holds only for values inside the
    calibrated range. Returns ``(q int8, scale float32)`` like :func:`quantize_page`."""
    scale = np.asarray(scale, np.float32)
    q = np.clip(np.rint(x.astype(np.float64) / scale.astype(np.float64)), -QMAX, QMAX).astype(np.int8)
    return q, scale.copy()


def dequantize_page(q: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """``q [Hkv, ps, D] int8 * scale [Hkv, ps|1, D|1]`` in ``dtype`` (math in float32, as the op)."""
    return (q.astype(np.float32) * scale.astype(np.float32)).astype(dtype)


def quantize_pages(x: np.ndarray, granularity: str) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized :func:`quantize_page` over full pages ``x [N, Hkv, ps, D]``."""
    if x.ndim != 4:
        raise ValueError(f"pages are [N, Hkv, ps, D], got shape {x.shape}")
    scale_shape(granularity, *x.shape[1:])
    axes = tuple(a + 1 for a in _reduce_axes(granularity))
    xf = x.astype(np.float64)
    amax = np.abs(xf).max(axis=axes, keepdims=True)
    scale = group_scale(amax, QMAX)
    q = np.clip(np.rint(xf / scale.astype(np.float64)), -QMAX, QMAX).astype(np.int8)
    return q, scale


def bytes_per_page(granularity: str, num_kv_heads: int, page_size: int, head_dim: int) -> int:
    """Bytes of one page's K (or V) cold storage: int8 values + float32 scales."""
    h, p, d = scale_shape(granularity, num_kv_heads, page_size, head_dim)
    return num_kv_heads * page_size * head_dim + 4 * h * p * d
