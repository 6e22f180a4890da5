"""INT4 cold pages in the ONNX function body: gather the packed bytes, unpack, scale.

The rule is ``ops/cold_codec.py``'s: byte ``j`` of a row holds channel ``j``
in its low nibble and ``j + D/2`` in its high one. Values: each ``q + 8``;
channel ``c`` is scaled by column ``c // (D / C)`` of the float16 scales
``[.., ps|1, C]``. Keys: each ``q`` in [0, 15] on the page's bounds,
``min(key_min + q * step, key_max)`` with ``step = (key_max - key_min) * f32(1/15)``
(float32, the bounds gathered by physical page id). Only the selected pages' bytes are gathered (by the body's
``gather_rows``), then unpacked - never the whole pool. Standard ops only: from
opset 18 BitwiseAnd / BitShift on uint8; before (the function supports 15-23),
a 256-entry lookup Gather per nibble. No Reshape: with no cached page the
gathers are empty and ORT's reshape fusion turns a computed shape into a -1
it cannot resolve on an empty tensor, so unpacking is a Concat of the two
nibble planes and the scales are widened to D by a Gather of their columns.
"""

from __future__ import annotations

import numpy as np

from .fine_bounds import INV_LEVELS

BITWISE_OPSET = 18  # BitwiseAnd appears in opset 18 (BitShift in 11)
FLOAT, INT32 = 1, 6  # TensorProto element types


def unpack(b, raw: str, offset: float = 8.0) -> str:
    """uint8 ``[B, Hkv, K, rows, D/2]`` -> float32 ``nibble - offset`` ``[B, Hkv, K, rows, D]``."""
    if b.opset >= BITWISE_OPSET:
        lo = b.op("BitwiseAnd", raw, b.const(15, np.uint8))
        hi = b.op("BitShift", raw, b.const(4, np.uint8), direction="RIGHT")
        both = b.op("Cast", b.op("Concat", lo, hi, axis=4), to=FLOAT)
        return b.op("Sub", both, b.const(offset, np.float32)) if offset else both
    byte = np.arange(256)
    idx = b.op("Cast", raw, to=INT32)
    lo = b.op("Gather", b.const((byte & 15) - offset, np.float32, f"lo_nibble{int(offset)}"), idx, axis=0)
    hi = b.op("Gather", b.const((byte >> 4) - offset, np.float32, f"hi_nibble{int(offset)}"), idx, axis=0)
    return b.op("Concat", lo, hi, axis=4)


def dequantize_int4_rows(b, gather_rows, packed: str, scale: str, ids: str, sub=None) -> str:
    """Cold pages ``ids [B, Hkv, K]`` (cold slots) as float32 ``[B, Hkv, K, ps|sp, D]``.

    ``gather_rows(pool, ids, sub, cast)`` is the body's row gather (``cast=False``
    keeps the bytes); ``sub`` selects sub-pages (two-level) as there."""
    one = b.const([1], np.int64, "i")
    q = unpack(b, gather_rows(packed, ids, sub, cast=False))  # [B, Hkv, K, rows, D]
    s = gather_rows(scale, ids, sub)  # float32 [B, Hkv, K, rows|1, C]
    D = b.dim(q, 4)
    C = b.dim(s, 4)
    column = b.op("Div", b.op("Range", b.scalar(b.op("Sub", D, D)), b.scalar(D), b.scalar(one)), b.op("Div", D, C))
    return b.op("Mul", q, b.op("Gather", s, column, axis=4))  # channel c: column c // (D / C)


def dequantize_int4_keys(b, gather_rows, packed: str, key_min: str, key_max: str, ids: str, phys: str,
                         sub=None) -> str:
    """Cold keys ``ids [B, Hkv, K]`` (cold slots; ``phys`` their physical ids, which index the
    bounds ``[Ptot, Hkv, D]``) as float32 ``[B, Hkv, K, ps|sp, D]`` on the page bounds."""
    q = unpack(b, gather_rows(packed, ids, sub, cast=False), offset=0.0)  # [B, Hkv, K, rows, D], q in [0, 15]
    lo, hi = (gather_rows(b.unsqueeze(m, [2]), phys, sub) for m in (key_min, key_max))  # [B, Hkv, K, 1, D]
    step = b.op("Mul", b.op("Sub", hi, lo), b.const(float(INV_LEVELS), np.float32))
    return b.op("Min", b.op("Add", lo, b.op("Mul", q, step)), hi)
