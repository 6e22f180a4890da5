"""INT4 cold pages in the ONNX function body: gather the packed bytes, unpack, scale.

The rule is ``ops/cold_codec.py``'s: byte ``j`` of a row holds channel ``2j``
in its low nibble and ``2j+1`` in its high one, each ``q + 8``; channel ``c``
is scaled by column ``c // (D / C)`` of the float16 scales ``[.., ps|1, C]``.
Only the selected pages' bytes are gathered (by the body's ``gather_rows``),
then unpacked - never the whole pool. Standard ops only: from opset 18
BitwiseAnd / BitShift on uint8; before (the function supports 15-23), a
256-entry lookup Gather of both nibbles' signed values.
"""

from __future__ import annotations

import numpy as np

from .cold_codec import unpack_int4

BITWISE_OPSET = 18  # BitwiseAnd appears in opset 18 (BitShift in 11)


def _nibble_table() -> np.ndarray:
    """``[256, 2]`` float32: the signed (low, high) values of every byte."""
    return unpack_int4(np.arange(256, dtype=np.uint8)[:, None]).astype(np.float32)


def unpack(b, raw: str) -> str:
    """uint8 ``[B, Hkv, K, rows, D/2]`` -> float32 signed values ``[B, Hkv, K, rows, D/2, 2]``."""
    if b.opset >= BITWISE_OPSET:
        lo = b.op("BitwiseAnd", raw, b.const(15, np.uint8))
        hi = b.op("BitShift", raw, b.const(4, np.uint8), direction="RIGHT")
        both = b.op("Concat", b.unsqueeze(lo, [5]), b.unsqueeze(hi, [5]), axis=5)
        return b.op("Sub", b.op("Cast", both, to=1), b.const(8.0, np.float32))  # 1 = FLOAT
    table = b.const(_nibble_table(), np.float32, "nibbles")
    return b.op("Gather", table, b.op("Cast", raw, to=6), axis=0)  # 6 = INT32


def dequantize_int4_rows(b, gather_rows, packed: str, scale: str, ids: str, sub=None) -> str:
    """Cold pages ``ids [B, Hkv, K]`` (cold slots) as float32 ``[B, Hkv, K, ps|sp, D]``.

    ``gather_rows(pool, ids, sub, cast)`` is the body's row gather (``cast=False``
    keeps the bytes); ``sub`` selects sub-pages (two-level) as there."""
    def i64(*xs):
        return b.const(list(xs), np.int64, "i")
    raw = gather_rows(packed, ids, sub, cast=False)  # uint8 [B, Hkv, K, rows, D/2]
    D = b.op("Mul", b.dim(b.op("Shape", raw), 4), i64(2))
    s = gather_rows(scale, ids, sub)  # float32 [B, Hkv, K, rows|1, C]
    C = b.dim(b.op("Shape", s), 4)
    # explicit dims (0 = copy): K may be 0 (no cached page), where -1 cannot be inferred
    q = b.op("Reshape", unpack(b, raw), b.cat(i64(0, 0, 0, 0), C, b.op("Div", D, C)))  # [.., rows, C, D/C]
    x = b.op("Mul", q, b.unsqueeze(s, [5]))
    return b.op("Reshape", x, b.cat(i64(0, 0, 0, 0), D))
