"""TierConfig: the cold INT8 tier's size and quantization, and what a cold page costs."""

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
    scales: str = "dynamic"  # or "static": the calibration's ranges (TieredPagePool(static_scales=...))

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
