"""INT4 cold pages in the ONNX function body: gather the packed bytes, unpack, dequantize.

The rule is ``ops/cold_codec.py``'s (format 3): byte ``j`` of a row holds channel ``j``
in its low nibble and ``j + D/2`` in its high one; every nibble is ``q`` in [0, 15].
Values: ``q * scale + vmin`` with channel ``c`` reading column ``c // (D / C)`` of the
float16 scales and column ``C + c // (D / C)`` of the mins (``value_scale [.., ps|1, 2C]``).
Keys: ``min(lo + q * step, hi)``, ``step = (hi - lo) * f32(1/15)``, on the page's bounds
(gathered by physical page id), or - two-level - on each token's sub-page bounds, which
the page's ``key_sub_bounds`` codes decode to (``fine_bounds.decode``: ``lo = key_min +
(code & 15) * step_page``, ``hi = key_max - (code >> 4) * step_page``). All float32,
one rounding per op, in the order written. Only the selected pages' bytes (and codes)
are gathered (by the body's ``gather_rows``), then unpacked - never the whole pool.
Standard ops only: from opset 18 BitwiseAnd / BitShift on uint8; before (the function
supports 15-23), a 256-entry lookup Gather per nibble. No Reshape: with no cached page
the gathers are empty and ORT's reshape fusion turns a computed shape into a -1 it
cannot resolve on an empty tensor, so unpacking is a Concat of the two nibble planes,
and scales and sub-page bounds are widened to channels / tokens by Gathers.
"""

from __future__ import annotations

import numpy as np

from .fine_bounds import BITS, INV_LEVELS, LEVELS, split_nibbles

BITWISE_OPSET = 18  # BitwiseAnd appears in opset 18 (BitShift in 11)
FLOAT, INT32 = 1, 6  # TensorProto element types


def nibbles(b, raw: str) -> tuple[str, str]:
    """uint8 ``raw`` -> float32 ``(low, high)`` nibbles (``fine_bounds.split_nibbles``), same shape."""
    if b.opset >= BITWISE_OPSET:
        lo = b.op("BitwiseAnd", raw, b.const(LEVELS, np.uint8))
        hi = b.op("BitShift", raw, b.const(BITS, np.uint8), direction="RIGHT")
        return b.op("Cast", lo, to=FLOAT), b.op("Cast", hi, to=FLOAT)
    lo_table, hi_table = split_nibbles(np.arange(256, dtype=np.uint8))  # every byte's nibbles, by the contract
    idx = b.op("Cast", raw, to=INT32)
    return (b.op("Gather", b.const(lo_table, np.float32, "lo_nibble"), idx, axis=0),
            b.op("Gather", b.const(hi_table, np.float32, "hi_nibble"), idx, axis=0))


def unpack(b, raw: str) -> str:
    """uint8 ``[B, Hkv, K, rows, D/2]`` -> float32 nibbles ``q`` ``[B, Hkv, K, rows, D]``, the low
    nibbles first (``cold_codec.unpack_nibbles``)."""
    return b.op("Concat", *nibbles(b, raw), axis=4)


def _range(b, n: str) -> str:
    one = b.const([1], np.int64, "i")
    return b.op("Range", b.scalar(b.op("Sub", n, n)), b.scalar(n), b.scalar(one))


def dequantize_int4_rows(b, gather_rows, packed: str, scale: str, ids: str, sub=None) -> str:
    """Cold values ``ids [B, Hkv, K]`` (cold slots) as float32 ``[B, Hkv, K, ps|sp, D]``.

    ``gather_rows(pool, ids, sub, cast)`` is the body's row gather (``cast=False``
    keeps the bytes); ``sub`` selects sub-pages (two-level) as there."""
    q = unpack(b, gather_rows(packed, ids, sub, cast=False))  # [B, Hkv, K, rows, D], q in [0, 15]
    s = gather_rows(scale, ids, sub)  # float32 [B, Hkv, K, rows|1, 2C]: scales, then mins
    D = b.dim(q, 4)
    C = b.op("Div", b.dim(s, 4), b.const([2], np.int64, "i"))
    column = b.op("Div", _range(b, D), b.op("Div", D, C))  # channel c: column c // (D / C)
    step, vmin = b.op("Gather", s, column, axis=4), b.op("Gather", s, b.op("Add", column, C), axis=4)
    return b.op("Add", b.op("Mul", q, step), vmin)


def dequantize_int4_keys(b, gather_rows, packed: str, key_min: str, key_max: str, ids: str, phys: str,
                         sub=None, codes: str | None = None) -> str:
    """Cold keys ``ids [B, Hkv, K]`` (cold slots; ``phys`` their physical ids, which index the
    bounds ``[Ptot, Hkv, D]`` and ``codes [Ptot, Hkv, r, D]``) as float32 ``[B, Hkv, K, ps|sp, D]``
    on the page bounds, or with ``codes`` (two-level) on the sub-page bounds."""
    q = unpack(b, gather_rows(packed, ids, sub, cast=False))  # [B, Hkv, K, rows, D], q in [0, 15]
    lo, hi = (gather_rows(b.unsqueeze(m, [2]), phys, sub) for m in (key_min, key_max))  # [B, Hkv, K, 1, D]
    if codes is not None:
        lo, hi = _sub_page_bounds(b, gather_rows, codes, lo, hi, phys, sub, b.dim(packed, 2))
    step = b.op("Mul", b.op("Sub", hi, lo), b.const(float(INV_LEVELS), np.float32))
    return b.op("Min", b.op("Add", lo, b.op("Mul", q, step)), hi)


def _sub_page_bounds(b, gather_rows, codes, kmin, kmax, phys, sub, ps):
    """Each gathered token's sub-page ``(lo, hi)`` ``[B, Hkv, K, ps|sp, D]`` from the page bounds
    ``kmin/kmax [B, Hkv, K, 1, D]`` and the codes of the slots' pages (``fine_bounds.decode``)."""
    r = b.dim(codes, 2)
    r_slot = b.const([1], np.int64, "i") if sub is None else sub[1]  # slots per page: 1 (whole pages) or r
    c = gather_rows(codes, phys, sub, cast=False, ra=r_slot)  # [B, Hkv, K, r / r_slot, D]: the slot's codes
    lo_c, hi_c = nibbles(b, c)
    page_step = b.op("Mul", b.op("Sub", kmax, kmin), b.const(float(INV_LEVELS), np.float32))
    lo = b.op("Add", kmin, b.op("Mul", lo_c, page_step))
    hi = b.op("Sub", kmax, b.op("Mul", hi_c, page_step))
    token_code = b.op("Div", _range(b, b.op("Div", ps, r_slot)), b.op("Div", ps, r))  # slot token t: code t // sp
    return b.op("Gather", lo, token_code, axis=3), b.op("Gather", hi, token_code, axis=3)
