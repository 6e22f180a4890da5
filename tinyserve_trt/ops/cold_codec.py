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
One definition for numpy and torch: every function below takes numpy arrays or torch tensors
(``ops/array_ns.py`` picks the ops; a GPU's pools, ``runtime/backends/device_pages.py``, run
these same lines on CUDA tensors), so the host pools, the reference, calibration and the device
pools hold the same bytes. Does not modify its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import fine_bounds
from .array_ns import namespace
from .fine_bounds import BITS, LEVELS, level_step, split_nibbles
from .quantization import GRANULARITIES, group_scale, scale_shape
from .schema import COLD_FORMATS

QMAX = {"int8": 127, "int4": 7}
# 3: keys on the sub-page bounds (two-level), asymmetric V. Not read: 2 (symmetric V, keys on the
# page bounds), 1 (symmetric keys).
INT4_FORMAT_VERSION = 3


def pack_nibbles(q):
    """INT4 nibbles ``q [..., D]`` in [0, 15] (D even) -> uint8 ``[..., D/2]``: channel ``j`` in the
    low nibble of byte ``j``, channel ``j + D/2`` in the high one."""
    if q.shape[-1] % 2:
        raise ValueError(f"INT4 packing needs an even last dim, got {q.shape[-1]}")
    xp = namespace(q)
    u, h = xp.astype(q, np.uint8), q.shape[-1] // 2
    return u[..., :h] | (u[..., h:] << BITS)


def unpack_nibbles(packed):
    """uint8 ``[..., D/2]`` -> uint8 nibbles ``q [..., D]`` in [0, 15] (inverse of :func:`pack_nibbles`)."""
    xp = namespace(packed)
    return xp.concat(split_nibbles(xp.asarray(packed)), axis=-1)


def expand_scale(scale, page_size: int, head_dim: int):
    """Scales ``[..., ps|1, C]`` -> ``[..., ps, D]`` by the rule above (float32)."""
    xp = namespace(scale)
    s = xp.astype(scale, np.float32)
    C = s.shape[-1]
    if head_dim % C:
        raise ValueError(f"a scale's last dim {C} must divide the head dim {head_dim}")
    s = xp.repeat(s, head_dim // C, axis=-1)
    return xp.broadcast_to(s, tuple(s.shape[:-2]) + (page_size, head_dim))


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
        if which == "k" and self.keys_on_bounds:
            return (num_kv_heads, 1, 1)  # placeholder: INT4 keys read the page bounds
        h, t, c = scale_shape(self.granularity(which), num_kv_heads, page_size, head_dim, self.group_size)
        return (h, t, c * (2 if self.cold_format == "int4" else 1))

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

    # ---- quantize / dequantize (numpy arrays or torch tensors) ----------------------
    def quantize(self, x, which: str, valid: int | None = None, scale=None, bounds: tuple | None = None,
                 sub_codes=None) -> tuple:
        """Pages ``x [..., Hkv, ps, D]`` -> ``(values, scales [..., Hkv, ps|1, C|2C])``, arrays of
        ``x``'s kind (a tensor's on its device).

        Scales come from the first ``valid`` tokens (a partial page's tail must not
        widen them), or are the given (calibrated, INT8 only) one-page ``scale [Hkv, ps|1, C]``,
        whose clip is the point. INT4 keys: ``bounds = (key_min, key_max) [..., Hkv, D]``, the
        page's metadata (default: :func:`page_bounds` of ``x``, what a pool stores for it), and in
        a two-level package ``sub_codes [..., Hkv, r, D]``, its ``key_sub_bounds`` (computed from ``x``)."""
        xp = namespace(x)
        x = xp.asarray(x)
        if x.ndim < 3:
            raise ValueError(f"pages are [..., Hkv, ps, D], got shape {tuple(x.shape)}")
        lead, (Hkv, ps, D) = tuple(x.shape[:-3]), tuple(x.shape[-3:])
        if valid is not None and not 0 <= int(valid) <= ps:
            raise ValueError(f"valid must be in [0, {ps}], got {valid}")
        shape = lead + self.scale_shape(which, Hkv, ps, D)
        if which == "k" and self.keys_on_bounds:
            if scale is not None:
                raise ValueError("int4 keys take no scale (they quantize on the page bounds)")
            kmin, kmax = page_bounds(x, valid) if bounds is None else bounds
            return quantize_on_bounds(x, kmin, kmax, sub_codes), xp.ones(shape, self.scale_dtype)
        xf = xp.astype(x, np.float64)
        if self.cold_format == "int4":
            if scale is not None:
                raise ValueError("int4 values take no calibrated scale (asymmetric per page)")
            return _quantize_asymmetric(xp, xf, valid, shape)
        if scale is None:
            absx = abs(xf)
            if valid is not None:
                absx[..., int(valid):, :] = 0.0
            C = shape[-1]
            amax = xp.amax(absx.reshape(tuple(absx.shape[:-1]) + (C, D // C)), axis=-1)  # [..., Hkv, ps, C]
            if shape[-2] == 1:
                amax = xp.amax(amax, axis=-2, keepdims=True)
            scale = group_scale(amax, self.qmax, self.scale_dtype)
        else:
            scale = xp.copy(xp.broadcast_to(xp.asarray(scale, self.scale_dtype), shape))
        full = xp.astype(expand_scale(scale, ps, D), np.float64)  # divide by the stored scale: the bound holds
        q = xp.clip(xp.rint(xf / full), -self.qmax, self.qmax)
        return xp.astype(q, np.int8), scale

    def dequantize(self, values, scale, dtype=np.float32):
        """``values [..., Hkv, ps, D|D/2]``, ``scale [..., Hkv, ps|1, C|2C]`` -> ``[..., Hkv, ps, D]``
        in ``dtype`` (numpy's, or torch's for tensors; math in float32, as the op). Values and INT8
        keys; INT4 keys: :meth:`dequantize_keys`."""
        xp = namespace(values)
        if self.cold_format == "int8":
            q = xp.astype(values, np.float32)
            return xp.astype(q * expand_scale(scale, q.shape[-2], q.shape[-1]), dtype)
        q = xp.astype(unpack_nibbles(values), np.float32)
        C = scale.shape[-1] // 2
        ps, D = q.shape[-2:]
        step, vmin = expand_scale(scale[..., :C], ps, D), expand_scale(scale[..., C:], ps, D)
        return xp.astype(q * step + vmin, dtype)  # the product rounds, then the sum: as the op

    def dequantize_keys(self, values, scale, key_min, key_max, dtype=np.float32, sub_codes=None):
        """Cold keys as the op reads them: INT4 on the page bounds ``key_min/key_max [..., Hkv, D]``
        or, given a two-level package's ``sub_codes [..., Hkv, r, D]``, on the sub-page bounds (the
        rule above; ``scale`` unused), INT8 by ``scale`` (the bounds and codes unused)."""
        if not self.keys_on_bounds:
            return self.dequantize(values, scale, dtype)
        return namespace(values).astype(dequantize_on_bounds(values, key_min, key_max, sub_codes), dtype)


def _quantize_asymmetric(xp, xf, valid: int | None, shape: tuple) -> tuple:
    """INT4 values ``xf [..., Hkv, ps, D]`` (float64) -> packed nibbles and ``[..., Hkv, ps|1, 2C]``
    float16 scales + mins (the rule above)."""
    ps, D = xf.shape[-2:]
    C = shape[-1] // 2
    # + 0.0 turns -0.0 into +0.0: a group of zeros of both signs has one min in numpy and torch
    # (their reductions order ties differently); its values decode the same either way
    grouped = xf.reshape(tuple(xf.shape[:-1]) + (C, D // C)) + 0.0
    lo, hi = xp.amin(grouped, axis=-1), xp.amax(grouped, axis=-1)  # [..., Hkv, ps, C]
    if valid is not None:  # a partial page's tail must not widen the groups
        tail = xp.arange(ps)[:, None] >= int(valid)
        lo, hi = xp.where(tail, float("inf"), lo), xp.where(tail, float("-inf"), hi)
    if shape[-2] == 1:
        lo, hi = xp.amin(lo, axis=-2, keepdims=True), xp.amax(hi, axis=-2, keepdims=True)
    lo, hi = xp.where(xp.isfinite(lo), lo, 0.0), xp.where(xp.isfinite(hi), hi, 0.0)  # rows with no valid token
    vmin = xp.astype(lo, np.float16)
    vmin = xp.where(xp.astype(vmin, np.float64) > lo, _f16_next(xp, vmin, up=False), vmin)  # round down
    span = xp.clip(hi - xp.astype(vmin, np.float64), 0.0, None)
    scale = group_scale(span, LEVELS, np.float16)
    scale = xp.where(xp.astype(scale, np.float64) * LEVELS < span, _f16_next(xp, scale, up=True), scale)  # up
    step = xp.astype(expand_scale(scale, ps, D), np.float64)
    base = xp.astype(expand_scale(vmin, ps, D), np.float64)
    q = xp.clip(xp.rint((xf - base) / step), 0, LEVELS)
    return pack_nibbles(q), xp.concat([scale, vmin], axis=-1)


def _f16_next(xp, h, up: bool):
    """The float16 next to ``h`` towards +inf (``up``, for ``h > 0``) or -inf, by its bits (as
    ``np.nextafter``; torch has no float16 nextafter on every device)."""
    bits = xp.bitcast(h, np.int16)
    if up:
        return xp.bitcast(xp.astype(bits + 1, np.int16), np.float16)
    down = xp.where(bits > 0, bits - 1, xp.where(bits == 0, -32767, bits + 1))  # -32767: -0x7fff, -denormal_min
    return xp.bitcast(xp.astype(down, np.int16), np.float16)


def page_bounds(x, valid: int | None = None) -> tuple:
    """``(min, max) [..., Hkv, D]`` of pages ``x [..., Hkv, ps, D]`` over their first ``valid`` tokens,
    in ``x``'s dtype: a pool's key_min/key_max of those keys."""
    xp = namespace(x)
    x = xp.asarray(x)
    n = x.shape[-2] if valid is None else int(valid)
    if not 1 <= n <= x.shape[-2]:
        raise ValueError(f"valid must be in [1, {x.shape[-2]}], got {valid}")
    return xp.amin(x[..., :n, :], axis=-2), xp.amax(x[..., :n, :], axis=-2)


def token_bounds(key_min, key_max, sub_codes=None, page_size: int = 1) -> tuple:
    """float32 ``(lo, hi)`` each INT4 key quantizes between: the page bounds ``[..., Hkv, D]`` as
    ``[..., Hkv, 1, D]``, or with ``sub_codes [..., Hkv, r, D]`` its sub-page's decoded fine bounds
    per token, ``[..., Hkv, page_size, D]``."""
    xp = namespace(key_min, key_max)
    if sub_codes is None:
        return xp.astype(key_min, np.float32)[..., None, :], xp.astype(key_max, np.float32)[..., None, :]
    r = sub_codes.shape[-2]
    if page_size % r:
        raise ValueError(f"{r} sub-pages do not divide the page size {page_size}")
    lo, hi = fine_bounds.decode(sub_codes, key_min, key_max)
    return xp.repeat(lo, page_size // r, axis=-2), xp.repeat(hi, page_size // r, axis=-2)


def quantize_on_bounds(x, key_min, key_max, sub_codes=None):
    """INT4 keys ``x [..., Hkv, ps, D]`` on the bounds ``[..., Hkv, D]`` (and sub-page codes, see
    :func:`token_bounds`): nibbles ``q`` in [0, 15], packed (``q = clip(rint((x - lo) / step), 0, 15)``;
    a zero-width channel gives 0)."""
    xp = namespace(x)
    lo, hi = token_bounds(key_min, key_max, sub_codes, x.shape[-2])
    step = xp.astype(level_step(lo, hi), np.float64)
    ok = step > 0
    d = (xp.astype(x, np.float64) - xp.astype(lo, np.float64)) / xp.where(ok, step, 1.0)
    return pack_nibbles(xp.clip(xp.where(ok, xp.rint(d), 0.0), 0, LEVELS))


def dequantize_on_bounds(values, key_min, key_max, sub_codes=None):
    """float32 ``min(lo + q * step, hi)`` of packed nibbles ``values [..., Hkv, ps, D/2]``
    (``hi < k ? hi : k``, as ``qsa_math.h``: a tie of zeros keeps ``k``'s sign, in numpy and torch alike)."""
    xp = namespace(values)
    q = xp.astype(unpack_nibbles(values), np.float32)
    lo, hi = token_bounds(key_min, key_max, sub_codes, q.shape[-2])
    k = lo + q * level_step(lo, hi)
    return xp.where(hi < k, hi, k)
