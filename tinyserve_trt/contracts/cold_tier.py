"""The cold tier's configs (INT8 or INT4 pages), shared by export, calibration and the runtime.

``TierConfig`` sizes and quantizes the cold pool (``runtime.tiers.pool.TieredPagePool``),
``HotnessConfig`` says which pages stay hot (``runtime.tiers.hotness.HotnessPolicy``);
a calibration artifact produces both (``contracts.calibration``), the exporter
records their values in the manifest's ``cold_tier`` (``contracts.manifest.ColdTier``)
and the runtime rebuilds them from it; :func:`cold_page_bytes` is what a cold
page costs (the runtime sizes pools with it, calibration reports memory with it).
Pure data: no pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from tinyserve_trt.ops.cold_codec import COLD_FORMATS, ColdCodec
from tinyserve_trt.ops.quantization import GRANULARITIES

SCALES = ("dynamic", "static")
# Channels per V (per-token) scale of INT4 pages: on SmolLM2 (benchmarks/results/
# quant_granularity_int4.md, page 16) V per token in groups of 16 has the lowest attention error
# of the pairs measured (0.125 vs 0.131 at 32, 0.138 ungrouped) for 6 more bytes per token and KV
# head (format 3, asymmetric: a float16 scale and min per group, 8 more). INT4 keys take no scale:
# per channel on the page (two-level: sub-page) bounds (ops/cold_codec.py).
INT4_GROUP_SIZE = 16
# Hot share of live pages an export's cold tier keeps when no calibration says otherwise, per cold
# format. INT4: 0.15 - on SmolLM2, fake-quantizing every cold page of 8 held-out prompts x 8
# positions (2K tokens, stdlib sources), KL to all-hot is 1.6e-4 at 15% hot and 1.5e-4 at 20% with
# the 3 most sensitive layers at INT8 (benchmarks/results/int4_layer_sensitivity.md), while 15% hot
# prices the KV at ~0.47 of all-FP16 instead of ~0.50. INT8: 0.5, the runtime's earlier default.
DEFAULT_HOT_FRACTION = {"int8": 0.5, "int4": 0.15}
# Share of an INT4 package's layers (rounded up) calibration keeps at INT8: its sensitivity pass
# ranks layers by KL. On SmolLM2 three of 30 layers carry 90% of the summed single-layer KL (layer
# 18 alone 63%) and INT8 for them cuts the all-INT4 KL by 79% on prompts that did not pick them
# (int4_layer_sensitivity.md), for 0.02 of the all-FP16 KV bytes.
INT8_LAYER_SHARE = 0.1


def default_int8_layers_count(num_layers: int) -> int:
    """INT8 layers calibration keeps in an INT4 package of ``num_layers`` layers by default."""
    return math.ceil(INT8_LAYER_SHARE * num_layers)


@dataclass(frozen=True)
class TierConfig:
    """The cold tier.

    num_cold_pages: cold slots (``Pcold >= 1``: the op's ``_int8``/``_int4`` overload needs one).
    cold_format: ``int8`` or ``int4`` (``ops.cold_codec``: two values per byte, float16 scales).
    group_size: int4 only - channels per ``token``/``head`` scale (0 = the whole head dim).
    k_granularity / v_granularity: scale granularity (``ops.quantization.GRANULARITIES``);
    per channel for K and per token for V is KIVI's choice, see
    ``benchmarks/results/quant_granularity.md`` for SmolLM2.
    scales: ``dynamic`` (each page's absmax) or ``static`` (a calibration's ranges, passed
    to ``TieredPagePool(static_scales=...)``; values outside them clip).
    int8_layers: int4 only - sorted layer indices whose cold pages are INT8 instead (the
    INT8 codec, same granularities; issue #17: calibration keeps sensitive layers at INT8).
    Their range is checked against the model by :meth:`check_layers` (the config has no layer count).
    """

    num_cold_pages: int = 1024
    k_granularity: str = "channel"
    v_granularity: str = "token"
    scales: str = "dynamic"
    cold_format: str = "int8"
    group_size: int = 0
    int8_layers: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "int8_layers", check_int8_layers(self.int8_layers, self.cold_format))
        if not isinstance(self.num_cold_pages, int) or isinstance(self.num_cold_pages, bool) \
                or self.num_cold_pages <= 0:
            raise ValueError(f"num_cold_pages must be a positive int, got {self.num_cold_pages!r}")
        for name in ("k_granularity", "v_granularity"):
            if getattr(self, name) not in GRANULARITIES:
                raise ValueError(f"{name} must be one of {GRANULARITIES}, got {getattr(self, name)!r}")
        if self.scales not in SCALES:
            raise ValueError(f"scales must be one of {SCALES}, got {self.scales!r}")
        if self.cold_format not in COLD_FORMATS:
            raise ValueError(f"cold_format must be one of {COLD_FORMATS}, got {self.cold_format!r}")
        if self.scales == "static" and self.cold_format != "int8":
            raise ValueError("static (calibrated) scales are implemented for int8 cold pages only")
        self.codec  # validates group_size

    @property
    def codec(self) -> ColdCodec:
        """How a cold page is stored (``ops.cold_codec``) in the layers not in ``int8_layers``."""
        return ColdCodec(self.cold_format, self.k_granularity, self.v_granularity, self.group_size)

    def layer_codec(self, layer: int) -> ColdCodec:
        """Layer ``layer``'s codec: INT8 for ``int8_layers``, else :attr:`codec`."""
        return int8_codec(self.codec) if layer in self.int8_layers else self.codec

    def layer_codecs(self, num_layers: int) -> list[ColdCodec]:
        """One codec per layer (``num_layers`` must cover ``int8_layers``)."""
        self.check_layers(num_layers)
        return [self.layer_codec(i) for i in range(num_layers)]

    def check_layers(self, num_layers: int) -> None:
        """ValueError when an ``int8_layers`` index is not a layer of a ``num_layers`` model."""
        bad = [i for i in self.int8_layers if i >= num_layers]
        if bad:
            raise ValueError(f"int8_layers {bad} out of range for a {num_layers}-layer model (0..{num_layers - 1})")

    def describe(self) -> str:
        """``int4`` or ``int4 (int8 layers 0,1)``: the format as tables and summaries print it."""
        return describe_format(self.cold_format, self.int8_layers)


def check_int8_layers(layers, cold_format: str) -> tuple:
    """``layers`` as a sorted tuple of unique ints >= 0, allowed with ``cold_format`` int4 only;
    ValueError naming the problem."""
    if layers is None:
        return ()
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise ValueError(f"int8_layers must be a list of layer indices, got {layers!r}")
    layers = list(layers)
    if any(not isinstance(i, (int, np.integer)) or isinstance(i, bool) or i < 0 for i in layers):
        raise ValueError(f"int8_layers must hold layer indices >= 0, got {layers}")
    if len(set(layers)) != len(layers):
        raise ValueError(f"int8_layers has duplicates: {layers}")
    if layers and cold_format != "int4":
        raise ValueError(f"int8_layers applies to int4 cold pages only (cold_format is {cold_format!r})")
    return tuple(sorted(int(i) for i in layers))


def int8_codec(codec: ColdCodec) -> ColdCodec:
    """The INT8 codec an int4 package's ``int8_layers`` use: INT8, the same V granularity, keys
    per channel (INT8's scale per channel, KIVI), group_size 0 (INT8 scales are ``[ps|1, D|1]``)."""
    return ColdCodec("int8", codec.k_granularity, codec.v_granularity, 0)


def describe_format(cold_format: str, int8_layers=()) -> str:
    return f"{cold_format} (int8 layers {','.join(map(str, int8_layers))})" if int8_layers else cold_format


def cold_page_bytes(tiers: TierConfig, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                    dtype: str = "float16") -> int:
    """Bytes one cold page costs over all layers, each in its own codec (``int8_layers``): int8
    (or packed int4) K/V, their scales, and key_min/key_max in ``dtype`` (compare
    ``CacheConfig.page_bytes`` for a hot page)."""
    meta = 2 * num_kv_heads * head_dim * np.dtype(dtype).itemsize
    return sum(sum(c.bytes_per_page(w, num_kv_heads, page_size, head_dim) for w in ("k", "v")) + meta
               for c in tiers.layer_codecs(num_layers))


def cold_page_ratio(tiers: TierConfig, page_size: int, head_dim: int, dtype: str = "float16") -> float:
    """What a cold page costs per hot ``dtype`` page (both with key_min/key_max in ``dtype``; the
    same for every layer and KV head): INT4 format 3 at page 32 / head dim 64, V per token in groups
    of 16 channels, is 0.334 of an FP16 page (format 2: 0.303). The package's format: ``int8_layers``
    are not counted (:func:`cold_page_bytes` sums the layers)."""
    item = np.dtype(dtype).itemsize
    hot = (2 * page_size * head_dim + 2 * head_dim) * item
    return cold_page_bytes(replace(tiers, int8_layers=()), page_size, 1, 1, head_dim, dtype) / hot


@dataclass(frozen=True)
class HotnessConfig:
    """decay: hit counts are multiplied by it every step, in (0, 1].
    sink_pages / recent_pages: leading / trailing logical pages of every holder kept hot
    (at least the op's ``sink_pages`` / ``recent_pages``: the op reads them every step).
    hot_fraction: target share of live pages kept hot, in [0, 1]; None = no fraction target.
    max_hot_pages: target hot page count; None = no count target. One of the two is required.
    promote_hits: a cold page whose decayed hit count (selections summed over layers and KV
    heads) reaches this returns to the hot tier when the hot count is below the target.
    max_promotions: promotions per rebalance at most (bounded work between steps; 0 = never).
    """

    decay: float = 0.9
    sink_pages: int = 1
    recent_pages: int = 2
    hot_fraction: float | None = 0.5
    max_hot_pages: int | None = None
    promote_hits: float = 1.0
    max_promotions: int = 8

    def __post_init__(self):
        if not isinstance(self.decay, (int, float)) or not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")
        for name in ("sink_pages", "recent_pages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.recent_pages < 1:
            raise ValueError("recent_pages must be >= 1: the page being written is never demoted")
        if self.hot_fraction is None and self.max_hot_pages is None:
            raise ValueError("give hot_fraction or max_hot_pages (or both)")
        if self.hot_fraction is not None and (not isinstance(self.hot_fraction, (int, float))
                                              or not 0.0 <= self.hot_fraction <= 1.0):
            raise ValueError(f"hot_fraction must be in [0, 1], got {self.hot_fraction!r}")
        if self.max_hot_pages is not None and (not isinstance(self.max_hot_pages, int)
                                               or self.max_hot_pages < 0):
            raise ValueError(f"max_hot_pages must be an int >= 0, got {self.max_hot_pages!r}")
        if not isinstance(self.promote_hits, (int, float)) or not self.promote_hits > 0:
            raise ValueError(f"promote_hits must be > 0, got {self.promote_hits!r}")
        if not isinstance(self.max_promotions, int) or isinstance(self.max_promotions, bool) \
                or self.max_promotions < 0:
            raise ValueError(f"max_promotions must be an int >= 0, got {self.max_promotions!r}")


def tier_codec(cold_tier: dict, layer: int | None = None) -> ColdCodec:
    """The codec of a manifest's ``cold_tier`` section (one written before INT4 is int8): the
    package's format, or with ``layer`` that layer's (INT8 when in ``int8_layers``)."""
    c = ColdCodec(cold_tier.get("cold_format", "int8"), cold_tier["k_granularity"], cold_tier["v_granularity"],
                  cold_tier.get("group_size", 0))
    return int8_codec(c) if layer is not None and layer in (cold_tier.get("int8_layers") or ()) else c


def tier_codecs(cold_tier: dict, num_layers: int) -> list[ColdCodec]:
    """Every layer's codec of a manifest's ``cold_tier`` section."""
    return [tier_codec(cold_tier, i) for i in range(num_layers)]


def unused_cold_inputs(cold_tier: dict, num_kv_heads: int, page_size: int, head_dim: int,
                       layer: int | None = None) -> dict:
    """One zero cold page per cold input (``ops.schema.COLD_INPUTS`` names) of ``layer``'s codec,
    for a cold-tier model run over a plain pool: page ids stay below the hot pool's size, so the
    op never reads it, but its cold overload needs ``Pcold >= 1`` of the right types."""
    c = tier_codec(cold_tier, layer)
    q = np.zeros((1, *c.pool_shape(num_kv_heads, page_size, head_dim)), c.storage_dtype)
    k, v = (c.blank_scales(w, num_kv_heads, page_size, head_dim)[None] for w in "kv")
    return dict(key_cache_int8=q, value_cache_int8=q.copy(), key_scale=k, value_scale=v)
