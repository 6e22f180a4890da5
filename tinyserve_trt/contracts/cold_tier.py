"""The INT8 cold tier's configs, shared by export, calibration and the runtime.

``TierConfig`` sizes and quantizes the cold pool (``runtime.tiers.pool.TieredPagePool``),
``HotnessConfig`` says which pages stay hot (``runtime.tiers.hotness.HotnessPolicy``);
a calibration artifact produces both (``contracts.calibration``), the exporter
records their values in the manifest's ``cold_tier`` (``contracts.manifest.ColdTier``)
and the runtime rebuilds them from it; :func:`cold_page_bytes` is what a cold
page costs (the runtime sizes pools with it, calibration reports memory with it).
Pure data: no pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyserve_trt.ops.quantization import GRANULARITIES, bytes_per_page

SCALES = ("dynamic", "static")


@dataclass(frozen=True)
class TierConfig:
    """The cold INT8 tier.

    num_cold_pages: cold slots (``Pcold >= 1``: the op's ``_int8`` overload needs one).
    k_granularity / v_granularity: scale granularity (``ops.quantization.GRANULARITIES``);
    per channel for K and per token for V is KIVI's choice, see
    ``benchmarks/results/quant_granularity.md`` for SmolLM2.
    scales: ``dynamic`` (each page's absmax) or ``static`` (a calibration's ranges, passed
    to ``TieredPagePool(static_scales=...)``; values outside them clip).
    """

    num_cold_pages: int = 1024
    k_granularity: str = "channel"
    v_granularity: str = "token"
    scales: str = "dynamic"

    def __post_init__(self):
        if not isinstance(self.num_cold_pages, int) or isinstance(self.num_cold_pages, bool) \
                or self.num_cold_pages <= 0:
            raise ValueError(f"num_cold_pages must be a positive int, got {self.num_cold_pages!r}")
        for name in ("k_granularity", "v_granularity"):
            if getattr(self, name) not in GRANULARITIES:
                raise ValueError(f"{name} must be one of {GRANULARITIES}, got {getattr(self, name)!r}")
        if self.scales not in SCALES:
            raise ValueError(f"scales must be one of {SCALES}, got {self.scales!r}")


def cold_page_bytes(tiers: TierConfig, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                    dtype: str = "float16") -> int:
    """Bytes one cold page costs over all layers: int8 K/V, their float32 scales, and
    key_min/key_max in ``dtype`` (compare ``CacheConfig.page_bytes`` for a hot page)."""
    kv = sum(bytes_per_page(g, num_kv_heads, page_size, head_dim) for g in (tiers.k_granularity,
                                                                            tiers.v_granularity))
    return num_layers * (kv + 2 * num_kv_heads * head_dim * np.dtype(dtype).itemsize)


@dataclass(frozen=True)
class HotnessConfig:
    """decay: hit counts are multiplied by it every step, in (0, 1].
    sink_pages / recent_pages: leading / trailing logical pages of every holder kept hot
    (at least the op's ``sink_pages`` / ``recent_pages``: the op reads them every step).
    hot_fraction: target share of live pages kept hot, in [0, 1]; None = no fraction target.
    max_hot_pages: target hot page count; None = no count target. One of the two is required.
    """

    decay: float = 0.9
    sink_pages: int = 1
    recent_pages: int = 2
    hot_fraction: float | None = 0.5
    max_hot_pages: int | None = None

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
