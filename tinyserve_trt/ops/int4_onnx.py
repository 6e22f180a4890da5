"""INT4 cold pages in the ONNX function body: gather the packed bytes, unpack, scale.

The rule is ``ops/cold_codec.py``'s: byte ``j`` of a row holds channel ``j``
in its low nibble and ``j + D/2`` in its high one, each ``q + 8``; channel
``c`` is scaled by column ``c // (D / C)`` of the float16 scales
``[.., ps|1, C]``. Only the selected pages' bytes are gathered (by the body's
``gather_rows``), then unpacked - never the whole pool. Standard ops only: from
opset 18 BitwiseAnd / BitShift on uint8; before (the function supports 15-23),
a 256-entry lookup Gather per nibble. No Reshape: with no cached page the
gathers are empty and ORT's reshape fusion turns a computed shape into a -1
it cannot resolve on an empty tensor, so unpacking is a Concat of the two
nibble planes and the scales are widened to D by a Gather of their columns.
"""

from __future__ import annotations

import numpy as np

BITWISE_OPSET = 18  # BitwiseAnd appears in opset 18 (BitShift in 11)
FLOAT, INT32 = 1, 6  # TensorProto element types


def unpack(b, raw: str) -> str:
    """uint8 ``[B, Hkv, K, rows, D/2]`` -> float32 signed values ``[B, Hkv, K, rows, D]``."""
    if b.opset >= BITWISE_OPSET:
        lo = b.op("BitwiseAnd", raw, b.const(15, np.uint8))
        hi = b.op("BitShift", raw, b.const(4, np.uint8), direction="RIGHT")
        both = b.op("Cast", b.op("Concat", lo, hi, axis=4), to=FLOAT)
        return b.op("Sub", both, b.const(8.0, np.float32))
    byte = np.arange(256)
    idx = b.op("Cast", raw, to=INT32)
    lo = b.op("Gather", b.const((byte & 15) - 8.0, np.float32, "lo_nibble"), idx, axis=0)
    hi = b.op("Gather", b.const((byte >> 4) - 8.0, np.float32, "hi_nibble"), idx, axis=0)
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
