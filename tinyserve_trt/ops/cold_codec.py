"""ColdCodec: how a cold KV page is stored - INT8 or packed INT4 - and the one dequantization rule.

Formats (``COLD_FORMATS``), per (page, KV head) of ``[ps, D]`` values:

  ``int8``  int8 ``[ps, D]``, float32 scales (``ops/quantization.py``), |q| <= 127
  ``int4``  uint8 ``[ps, D/2]``: channel ``j`` in the low nibble of byte ``j``, ``j + D/2`` in
            the high one (halves, not neighbours: unpacking is a Concat of the two nibble
            planes, no interleaving reshape in the ONNX body or the kernels). Every nibble is
            ``q`` in [0, 15]: V asymmetric on a float16 scale and min per group, K on the
            page's (or sub-page's) own bounds (below).

INT4 format version 3 (``INT4_FORMAT_VERSION``; the manifest records it and refuses older
packages: 2 had symmetric V and keys on the page bounds in two-level packages too).

Keys are asymmetric, per channel, on bounds every page stores anyway (KIVI's zero point
+ scale at no extra bytes): in a two-level node (``sub_page_size`` in (0, ps), it reads
``key_sub_bounds``) on the SUB-PAGE bounds ``lo/hi`` that the codes decode to
(``fine_bounds.decode``, float32), in a single-level one - a single-level package, or a
two-level package's dense layers, whose nodes take no codes - on the page's
``key_min``/``key_max`` (``lo/hi`` then); a pool quantizes each layer as its node reads
(``KVStorage.two_level_layers``)::

    step = (hi - lo) * float32(1/15)       # fine_bounds.level_step, float32
    k'   = min(lo + q * step, hi)          # single-rounded float32 ops (no FMA)

so ``lo <= k' <= hi``: the page bounds and the sub-page codes (computed from the hot
keys, which they hold) stay upper bounds of what the op attends, and demotion does not
change a page's metadata. The sub-page bounds cut SmolLM2's attention error from K 1.8x
at page 32 / sub-page 4 (0.0406 -> 0.0225, benchmarks/results/int4_cold_keys.md). An
empty sub-page (past a partial page's valid tokens) has code 0, which decodes to the
page bounds exactly; a partial sub-page's invalid tail tokens are clipped into its
bounds (never attended). ``key_sub_bounds`` with one sub-page per page (``sp == ps``)
are 0: the page bounds. The INT4 ``key_scale`` input is a ``[.., 1, 1]`` placeholder
(ones) the op does not read.

Values are asymmetric in groups (``v_granularity``/``group_size``: per token in groups
of 16 channels by default): float16 ``scale`` and ``vmin`` per group, stored as one
``value_scale`` ``[.., ps|1, 2C]`` - columns ``[0, C)`` the scales, ``[C, 2C)`` the mins::

    v' = q * scale + vmin                  # float32, single-rounded (no FMA)

``vmin`` is the group's min rounded DOWN to float16, ``scale`` ``(max - vmin) / 15``
rounded UP (at least float16's smallest normal), ``q = rint((v - vmin) / scale)``, so
``|v - v'| <= scale / 2`` (+ float32 rounding) for values within float16's range.
Against format 2's symmetric V this cuts V's attention error 0.044 -> 0.031 for 2 bytes
more per group (a cold page ~0.33 of an FP16 page instead of 0.30).

Scales ``[ps|1, C]`` (INT4 V: ``C`` of the ``2C`` columns) with ``C`` dividing ``D``:
channel ``c`` uses column ``c // (D / C)``, token ``t`` row ``t`` (or row 0).
Granularity names which axes one scale spans (``quantization.GRANULARITIES``) and
``group_size`` how many channels a ``token``/``head`` scale covers (0 = all ``D``)::

  channel  [1, D]              one scale per channel over the page's tokens (INT8 K, KIVI)
  token    [ps, D/group]       one per token and channel group (V, KIVI)
  head     [1, D/group]        one per channel group over the page

INT8 takes ``group_size`` 0 only (its scales stay ``[ps|1, D|1]``, what the CUDA kernels
read) and is symmetric: ``scale = absmax / 127`` of the group (1 when all zero, clamped to
float32's normal range: ``quantization.group_scale``), ``q = clip(rint(x / scale), -127, 127)``,
so ``|x - q * scale| <= scale / 2``. INT4 keys take ``channel`` only (the bounds rule):
``|x - k'| <= step / 2`` (plus float32 rounding) for values inside the bounds.
Pure numpy; does not modify its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import fine_bounds
from .fine_bounds import LEVELS, level_step
from .quantization import GRANULARITIES, group_scale
from .schema import COLD_FORMATS

QMAX = {"int8": 127, "int4": 7}
# 3: keys on the sub-page bounds (two-level), asymmetric V. Not read: 2 (symmetric V, keys on the
# page bounds), 1 (symmetric keys).
INT4_FORMAT_VERSION = 3


def pack_int4(q: np.ndarray) -> np.ndarray:
    """``q [..., D]`` ints in [-8, 7] (D even) -> uint8 ``[..., D/2]`` (offset binary nibbles,
    the first half of the channels low, the second half high)."""
    if q.shape[-1] % 2:
        raise ValueError(f"INT4 packing needs an even last dim, got {q.shape[-1]}")
    u = (np.asarray(q, np.int16) + 8).astype(np.uint8)
    h = q.shape[-1] // 2
    return (u[..., :h] | (u[..., h:] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """uint8 ``[..., D/2]`` -> int8 ``[..., D]`` (inverse of :func:`pack_int4`)."""
    p = np.asarray(packed, np.uint8)
    return np.concatenate([(p & 15).astype(np.int8) - 8, (p >> 4).astype(np.int8) - 8], axis=-1)


def expand_scale(scale: np.ndarray, page_size: int, head_dim: int) -> np.ndarray:
    """Scales ``[..., ps|1, C]`` -> ``[..., ps, D]`` by the rule above (float32)."""
    s = np.asarray(scale, np.float32)
    C = s.shape[-1]
    if head_dim % C:
        raise ValueError(f"a scale's last dim {C} must divide the head dim {head_dim}")
    s = np.repeat(s, head_dim // C, axis=-1)
    return np.broadcast_to(s, s.shape[:-2] + (page_size, head_dim))


@dataclass(frozen=True)
class ColdCodec:
    """One cold format with the K and V scale granularities (``TierConfig`` carries the same fields)."""

    cold_format: str = "int8"
    k_granularity: str = "channel"
    v_granularity: str = "token"
    group_size: int = 0

    def __post_init__(self):
        if self.cold_format not in COLD_FORMATS:
            raise ValueError(f"cold_format must be one of {COLD_FORMATS}, got {self.cold_format!r}")
        for name in ("k_granularity", "v_granularity"):
            if getattr(self, name) not in GRANULARITIES:
                raise ValueError(f"{name} must be one of {GRANULARITIES}, got {getattr(self, name)!r}")
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 0:
            raise ValueError(f"group_size must be an int >= 0 (0 = the whole head dim), got {self.group_size!r}")
        if self.cold_format == "int4" and self.k_granularity != "channel":
            raise ValueError("int4 keys are quantized per channel on the page's key_min/key_max: "
                             f"k_granularity must be 'channel', got {self.k_granularity!r}")
        if self.cold_format == "int8" and self.group_size:
            raise ValueError("group_size applies to int4 cold pages only (int8 scales are [ps|1, D|1])")
        if self.group_size & (self.group_size - 1):
            raise ValueError(f"group_size must be a power of two, got {self.group_size}")

    @property
    def qmax(self) -> int:
        return QMAX[self.cold_format]

    @property
    def keys_on_bounds(self) -> bool:
        """INT4: keys dequantize on the page's key_min/key_max (no K scale)."""
        return self.cold_format == "int4"

    @property
    def storage_dtype(self):
        return np.int8 if self.cold_format == "int8" else np.uint8

    @property
    def scale_dtype(self):
        return np.float32 if self.cold_format == "int8" else np.float16

    def granularity(self, which: str) -> str:
        return {"k": self.k_granularity, "v": self.v_granularity}[which]

    def pool_shape(self, num_kv_heads: int, page_size: int, head_dim: int) -> tuple[int, int, int]:
        """One cold page's stored values: ``[Hkv, ps, D]`` (int8) or ``[Hkv, ps, D/2]`` (int4)."""
        if self.cold_format == "int4" and head_dim % 2:
            raise ValueError(f"int4 cold pages need an even head dim, got {head_dim}")
        return (num_kv_heads, page_size, head_dim // (2 if self.cold_format == "int4" else 1))

    def scale_shape(self, which: str, num_kv_heads: int, page_size: int, head_dim: int) -> tuple[int, int, int]:
        """One page's ``which`` ("k"/"v") scales ``[Hkv, ps|1, C]`` (INT4 V: ``[Hkv, ps|1, 2C]``,
        the scales then the mins)."""
        g = self.granularity(which)
        if which == "k" and self.keys_on_bounds:
            return (num_kv_heads, 1, 1)  # placeholder: INT4 keys read the page bounds
        group = self.group_size or head_dim
        if head_dim % group:
            raise ValueError(f"group_size {group} must divide the head dim {head_dim}")
        C = head_dim if g == "channel" else head_dim // group
        return (num_kv_heads, page_size if g == "token" else 1, C * (2 if self.cold_format == "int4" else 1))

    def blank_scales(self, which: str, num_kv_heads: int, page_size: int, head_dim: int) -> np.ndarray:
        """Scales of an unused cold page: 1 (INT4 V: scales 1, mins 0), so zero values read as 0
        (INT4 keys: nibbles 0 read as the page's lower bound)."""
        s = np.ones(self.scale_shape(which, num_kv_heads, page_size, head_dim), self.scale_dtype)
        if which == "v" and self.cold_format == "int4":
            s[..., s.shape[-1] // 2:] = 0
        return s

    def bytes_per_page(self, which: str, num_kv_heads: int, page_size: int, head_dim: int) -> int:
        """Bytes of one page's K (or V) cold storage: values + scales."""
        n = int(np.prod(self.pool_shape(num_kv_heads, page_size, head_dim)))
        return n + np.dtype(self.scale_dtype).itemsize * int(np.prod(self.scale_shape(which, num_kv_heads,
                                                                                      page_size, head_dim)))

    # ---- quantize / dequantize ----------------------------------------------------
    def quantize(self, x: np.ndarray, which: str, valid: int | None = None,
                 scale: np.ndarray | None = None, bounds: tuple | None = None,
                 sub_codes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Pages ``x [..., Hkv, ps, D]`` -> ``(values, scales [..., Hkv, ps|1, C|2C])``.

        Scales come from the first ``valid`` tokens (a partial page's tail must not
        widen them), or are the given (calibrated, INT8 only) ``scale``, whose clip is the point.
        INT4 keys: ``bounds = (key_min, key_max) [..., Hkv, D]``, the page's metadata
        (default: :func:`page_bounds` of ``x``, what a pool stores for it), and in a two-level
        package ``sub_codes [..., Hkv, r, D]``, its ``key_sub_bounds`` (computed from ``x``)."""
        x = np.asarray(x)
        Hkv, ps, D = x.shape[-3:]
        if which == "k" and self.keys_on_bounds:
            if scale is not None:
                raise ValueError("int4 keys take no scale (they quantize on the page bounds)")
            kmin, kmax = page_bounds(x, valid) if bounds is None else bounds
            return quantize_on_bounds(x, kmin, kmax, sub_codes), np.ones(x.shape[:-3] + self.scale_shape(
                "k", Hkv, ps, D), self.scale_dtype)
        shape = self.scale_shape(which, Hkv, ps, D)
        xf = x.astype(np.float64)
        if self.cold_format == "int4":
            if scale is not None:
                raise ValueError("int4 values take no calibrated scale (asymmetric per page)")
            return _quantize_asymmetric(xf, valid, shape)
        if scale is None:
            absx = np.abs(xf)
            if valid is not None:
                absx[..., int(valid):, :] = 0.0
            C = shape[2]
            grouped = absx.reshape(absx.shape[:-1] + (C, D // C))
            amax = grouped.max(axis=-1)  # [..., Hkv, ps, C]
            if shape[1] == 1:
                amax = amax.max(axis=-2, keepdims=True)
            scale = group_scale(amax, self.qmax, self.scale_dtype)
        scale = np.asarray(scale, self.scale_dtype)
        full = expand_scale(scale, ps, D).astype(np.float64)  # divide by the stored scale: the bound holds for it
        q = np.clip(np.rint(xf / full), -self.qmax, self.qmax)
        return q.astype(np.int8), scale.copy()

    def dequantize(self, values: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
        """``values [..., Hkv, ps, D|D/2]``, ``scale [..., Hkv, ps|1, C|2C]`` -> ``[..., Hkv, ps, D]``
        in ``dtype`` (math in float32, as the op). Values and INT8 keys; INT4 keys: :meth:`dequantize_keys`."""
        if self.cold_format == "int8":
            q = np.asarray(values)
            return (q.astype(np.float32) * expand_scale(scale, q.shape[-2], q.shape[-1])).astype(dtype)
        q = (unpack_int4(values).astype(np.int16) + 8).astype(np.float32)
        s = np.asarray(scale)
        C = s.shape[-1] // 2
        ps, D = q.shape[-2:]
        step, vmin = expand_scale(s[..., :C], ps, D), expand_scale(s[..., C:], ps, D)
        return (q * step + vmin).astype(dtype)  # numpy rounds the product, then the sum: as the op

    def dequantize_keys(self, values: np.ndarray, scale: np.ndarray, key_min: np.ndarray, key_max: np.ndarray,
                        dtype=np.float32, sub_codes: np.ndarray | None = None) -> np.ndarray:
        """Cold keys as the op reads them: INT4 on the page bounds ``key_min/key_max [..., Hkv, D]``
        or, given a two-level package's ``sub_codes [..., Hkv, r, D]``, on the sub-page bounds (the
        rule above; ``scale`` unused), INT8 by ``scale`` (the bounds and codes unused)."""
        if not self.keys_on_bounds:
            return self.dequantize(values, scale, dtype)
        return dequantize_on_bounds(values, key_min, key_max, sub_codes).astype(dtype)


def _quantize_asymmetric(xf: np.ndarray, valid: int | None, shape: tuple) -> tuple[np.ndarray, np.ndarray]:
    """INT4 values ``xf [..., Hkv, ps, D]`` (float64) -> packed nibbles and ``[..., Hkv, ps|1, 2C]``
    float16 scales + mins (the rule above)."""
    ps, D = xf.shape[-2:]
    C = shape[2] // 2
    grouped = xf.reshape(xf.shape[:-1] + (C, D // C))
    lo, hi = grouped.min(axis=-1), grouped.max(axis=-1)  # [..., Hkv, ps, C]
    if valid is not None:  # a partial page's tail must not widen the groups
        tail = np.arange(ps)[:, None] >= int(valid)
        lo, hi = np.where(tail, np.inf, lo), np.where(tail, -np.inf, hi)
    if shape[1] == 1:
        lo, hi = lo.min(axis=-2, keepdims=True), hi.max(axis=-2, keepdims=True)
    lo, hi = np.where(np.isfinite(lo), lo, 0.0), np.where(np.isfinite(hi), hi, 0.0)  # rows with no valid token
    vmin = lo.astype(np.float16)
    vmin = np.where(vmin.astype(np.float64) > lo, np.nextafter(vmin, np.float16(-np.inf)), vmin)  # round down
    span = np.maximum(hi - vmin.astype(np.float64), 0.0)
    scale = group_scale(span, LEVELS, np.float16)
    scale = np.where(scale.astype(np.float64) * LEVELS < span, np.nextafter(scale, np.float16(np.inf)), scale)
    step, base = expand_scale(scale, ps, D).astype(np.float64), expand_scale(vmin, ps, D).astype(np.float64)
    q = np.clip(np.rint((xf - base) / step), 0, LEVELS)
    return pack_int4(q - 8), np.concatenate([scale, vmin], axis=-1).astype(np.float16)


def page_bounds(x: np.ndarray, valid: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(min, max) [..., Hkv, D]`` of pages ``x [..., Hkv, ps, D]`` over their first ``valid`` tokens,
    in ``x``'s dtype: a pool's key_min/key_max of those keys."""
    x = np.asarray(x)
    n = x.shape[-2] if valid is None else int(valid)
    if not 1 <= n <= x.shape[-2]:
        raise ValueError(f"valid must be in [1, {x.shape[-2]}], got {valid}")
    return x[..., :n, :].min(axis=-2), x[..., :n, :].max(axis=-2)


def token_bounds(key_min: np.ndarray, key_max: np.ndarray, sub_codes: np.ndarray | None = None,
                 page_size: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``(lo, hi)`` each INT4 key quantizes between: the page bounds ``[..., Hkv, D]`` as
    ``[..., Hkv, 1, D]``, or with ``sub_codes [..., Hkv, r, D]`` its sub-page's decoded fine bounds
    per token, ``[..., Hkv, page_size, D]``."""
    if sub_codes is None:
        return (np.asarray(key_min).astype(np.float32)[..., None, :],
                np.asarray(key_max).astype(np.float32)[..., None, :])
    r = sub_codes.shape[-2]
    if page_size % r:
        raise ValueError(f"{r} sub-pages do not divide the page size {page_size}")
    lo, hi = fine_bounds.decode(np.asarray(sub_codes), np.asarray(key_min), np.asarray(key_max))
    return np.repeat(lo, page_size // r, axis=-2), np.repeat(hi, page_size // r, axis=-2)


def quantize_on_bounds(x: np.ndarray, key_min: np.ndarray, key_max: np.ndarray,
                       sub_codes: np.ndarray | None = None) -> np.ndarray:
    """INT4 keys ``x [..., Hkv, ps, D]`` on the bounds ``[..., Hkv, D]`` (and sub-page codes, see
    :func:`token_bounds`): nibbles ``q`` in [0, 15], packed (``q = clip(rint((x - lo) / step), 0, 15)``;
    a zero-width channel gives 0)."""
    lo, hi = token_bounds(key_min, key_max, sub_codes, np.shape(x)[-2])
    step = level_step(lo, hi).astype(np.float64)
    q = np.where(step > 0, np.rint((np.asarray(x, np.float64) - lo) / np.where(step > 0, step, 1.0)), 0.0)
    return pack_int4(np.clip(q, 0, LEVELS) - 8)


def dequantize_on_bounds(values: np.ndarray, key_min: np.ndarray, key_max: np.ndarray,
                         sub_codes: np.ndarray | None = None) -> np.ndarray:
    """float32 ``min(lo + q * step, hi)`` of packed nibbles ``values [..., Hkv, ps, D/2]``."""
    q = (unpack_int4(values).astype(np.int16) + 8).astype(np.float32)
    lo, hi = token_bounds(key_min, key_max, sub_codes, q.shape[-2])
    return np.minimum(lo + q * level_step(lo, hi), hi)
