"""Compact sub-page key bounds for two-level selection (``schema.INPUTS`` ``key_sub_bounds``).

A page of ``ps`` tokens splits into ``r = ps / sp`` sub-pages. Each sub-page's
key min and max per channel are stored relative to the page's coarse
``[key_min, key_max]`` in 4 bits each, packed in one uint8 per
(page, KV head, sub-page, channel)::

    step = (key_max - key_min) * (1 / 15)          # float32, as the op computes it
    lo   = key_min + (code & 15)  * step           # the sub-page's min, rounded down
    hi   = key_max - (code >> 4)  * step           # its max, rounded up

Codes round outward - the encoder checks the decode in the op's float32
arithmetic and widens a code until ``lo <= k <= hi`` holds for every valid key
``k`` of the sub-page - so ``sum_i max(q_i*lo_i, q_i*hi_i)`` stays an upper
bound of ``q . k`` like the page's own score. Code 0 decodes to the coarse bound
exactly, so a widened code always ends at a valid bound. Cold pages: encode the
DEQUANTIZED keys, against the coarse bounds of those (what the op attends).
A CUDA decoder must compute ``lo``/``hi`` with the same single-rounded float32
steps (no FMA contraction), or re-check the bound itself.

Memory (per token, KV head and layer, FP16 cache, head dim D): K+V take
``4 D`` bytes; coarse min/max ``4 D / ps``; the fine codes ``D / sp``. At
ps 16 / sp 4: ``D/4 + D/4`` = 12.5% of the KV bytes (8-bit codes would make it
18.75%: two bytes per channel per sub-page). numpy (the decode also on torch tensors,
``ops/array_ns.py``); does not modify inputs.
"""

from __future__ import annotations

import numpy as np

from .array_ns import namespace

BITS = 4
LEVELS = (1 << BITS) - 1  # 15 steps between the coarse min and max
INV_LEVELS = np.float32(1.0 / LEVELS)


def split_nibbles(packed):
    """uint8 bytes -> ``(packed & 15, packed >> 4)``, uint8 of the same shape: the two 4-bit codes
    of a byte, low then high (a sub-page's lo/hi code here; two INT4 cold values in
    ``ops/cold_codec.py``). numpy arrays or torch tensors."""
    return packed & LEVELS, packed >> BITS


def level_step(page_min, page_max):
    """``(key_max - key_min) * float32(1/15)`` in float32: one of the 15 steps between a page's
    bounds (the fine codes' unit, and the INT4 cold keys' quantization step: ``ops/cold_codec.py``).
    numpy arrays or torch tensors (``ops/array_ns.py``)."""
    xp = namespace(page_min, page_max)
    return (xp.astype(page_max, np.float32) - xp.astype(page_min, np.float32)) * INV_LEVELS


def decode(codes, page_min, page_max):
    """``codes [..., r, D]`` uint8 with the page bounds ``[..., D]`` -> ``(lo, hi)`` float32 ``[..., r, D]``
    (numpy arrays or torch tensors: the one decoder of both)."""
    xp = namespace(codes, page_min, page_max)
    kmin = xp.astype(page_min, np.float32)[..., None, :]
    kmax = xp.astype(page_max, np.float32)[..., None, :]
    step = level_step(page_min, page_max)[..., None, :]
    lo_c, hi_c = (xp.astype(c, np.float32) for c in split_nibbles(xp.asarray(codes)))
    return kmin + lo_c * step, kmax - hi_c * step


def encode(sub_min: np.ndarray, sub_max: np.ndarray, page_min: np.ndarray, page_max: np.ndarray) -> np.ndarray:
    """Codes ``[..., r, D]`` uint8 of sub-page bounds ``sub_min/sub_max [..., r, D]`` inside the page
    bounds ``[..., D]``. Requires ``page_min <= sub_min`` and ``sub_max <= page_max`` (what the
    page's own metadata promises); then ``decode`` gives ``lo <= sub_min`` and ``hi >= sub_max``."""
    kmin = page_min.astype(np.float32)[..., None, :]
    kmax = page_max.astype(np.float32)[..., None, :]
    if np.any(sub_min.astype(np.float32) < kmin) or np.any(sub_max.astype(np.float32) > kmax):
        raise ValueError("sub-page bounds fall outside the page's key_min/key_max")
    step = level_step(page_min, page_max)[..., None, :].astype(np.float64)
    safe = np.where(step > 0, step, 1.0)
    lo_c = np.where(step > 0, np.floor((sub_min.astype(np.float64) - kmin) / safe), 0)
    hi_c = np.where(step > 0, np.floor((kmax - sub_max.astype(np.float64)) / safe), 0)
    lo_c, hi_c = np.clip(lo_c, 0, LEVELS), np.clip(hi_c, 0, LEVELS)
    smin, smax = sub_min.astype(np.float32), sub_max.astype(np.float32)
    while True:  # float32 rounding of the decode may land inside: widen by one step (code 0 is exact)
        lo, hi = decode((lo_c + (hi_c * (1 << BITS))).astype(np.uint8), page_min, page_max)
        bad_lo, bad_hi = lo > smin, hi < smax
        if not (bad_lo.any() or bad_hi.any()):
            break
        lo_c, hi_c = lo_c - bad_lo, hi_c - bad_hi
    return (lo_c + hi_c * (1 << BITS)).astype(np.uint8)


def page_sub_bounds(keys: np.ndarray, sub_page_size: int, page_min: np.ndarray, page_max: np.ndarray,
                    valid: int | None = None) -> np.ndarray:
    """Codes ``[Hkv, r, D]`` of one page ``keys [Hkv, ps, D]`` (the keys the op attends: dequantized
    for a cold page) whose coarse bounds are ``page_min/page_max [Hkv, D]``. Only the first ``valid``
    tokens count; a sub-page with none gets code 0 (the coarse bounds)."""
    valid = keys.shape[1] if valid is None else int(valid)
    return pages_sub_bounds(keys[None], sub_page_size, page_min[None], page_max[None], np.array([valid]))[0]


def pages_sub_bounds(keys: np.ndarray, sub_page_size: int, page_min: np.ndarray, page_max: np.ndarray,
                     valid: np.ndarray) -> np.ndarray:
    """:func:`page_sub_bounds` of ``U`` pages at once: ``keys [U, Hkv, ps, D]``, bounds ``[U, Hkv, D]``,
    ``valid [U]`` tokens each -> codes ``[U, Hkv, r, D]`` (what a page pool stores per write)."""
    U, Hkv, ps, D = keys.shape
    if sub_page_size < 1 or ps % sub_page_size:
        raise ValueError(f"sub_page_size must divide the page size {ps}, got {sub_page_size}")
    r = ps // sub_page_size
    k = keys.astype(np.float32).reshape(U, Hkv, r, sub_page_size, D)
    written = (np.arange(ps)[None, :] < np.asarray(valid).reshape(U, 1)).reshape(U, 1, r, sub_page_size, 1)
    smin = k.min(axis=3, where=written, initial=np.inf)  # where=: no masked copies of the keys
    smax = k.max(axis=3, where=written, initial=-np.inf)
    empty = ~written.any(axis=3)  # [U, 1, r, 1]
    kmin32 = np.broadcast_to(page_min.astype(np.float32)[:, :, None, :], smin.shape)
    kmax32 = np.broadcast_to(page_max.astype(np.float32)[:, :, None, :], smax.shape)
    smin, smax = np.where(empty, kmin32, smin), np.where(empty, kmax32, smax)
    return encode(smin, smax, page_min, page_max)


def metadata_bytes_per_token(page_size: int, sub_page_size: int, head_dim: int, meta_bytes: int = 2) -> float:
    """Selection metadata bytes per token, KV head and layer: coarse min/max in ``meta_bytes``
    (the cache dtype) plus, if two-level, the 1-byte fine codes."""
    coarse = 2 * meta_bytes * head_dim / page_size
    fine = head_dim / sub_page_size if sub_page_size and sub_page_size != page_size else 0.0
    return coarse + fine


def kv_bytes_per_token(head_dim: int, kv_bytes: int = 2) -> int:
    """K + V bytes per token, KV head and layer."""
    return 2 * kv_bytes * head_dim
