"""Tiering: the engine's side of hot/cold mixed-precision KV pages (issue #6).

A package exported with a cold tier (``tinyserve-export --calibration``) runs
over a :class:`~tinyserve_trt.runtime.tiers.pool.TieredPagePool`. Every step the
engine hands this class the op's ``selected_pages`` (before ``postprocess``,
while the batch's page handles are still held) and, after ``postprocess``,
asks it to demote: the :class:`~tinyserve_trt.runtime.tiers.hotness.HotnessPolicy`
picks the least selected full pages beyond the hot target, the pool quantizes
them. Nothing here runs the model or touches page ids.

Sizing: the engine's page count ``N`` (``EngineConfig.cache_config``) is the
number of page *handles* the scheduler may use. Hot slots are the policy's
target for ``N`` live pages plus headroom for what one step allocates before
the next demotion (every sequence's protected pages and one step's new
tokens); cold slots cover the rest of ``N``. So with hot fraction ``f`` the
pools hold about ``f*N`` float pages and ``(1-f)*N`` INT8 ones instead of
``N`` float pages.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from tinyserve_trt.contracts.calibration import CalibrationArtifact
from tinyserve_trt.contracts.cold_tier import HotnessConfig, TierConfig, cold_page_bytes
from tinyserve_trt.runtime.config import CacheConfig, EngineConfig
from tinyserve_trt.runtime.kv_storage import SUB_ROLES
from tinyserve_trt.runtime.tiers.hotness import HotnessPolicy
from tinyserve_trt.runtime.tiers.pool import TieredPagePool


class Tiering:
    """A tiered pool sized for ``cache.num_pages`` handles, its hotness policy, and counters."""

    def __init__(self, package, cache: CacheConfig, config: EngineConfig):
        tier = package.cold_tier
        if tier is None:
            raise ValueError(f"{package.path}: the package has no cold tier (export it with --calibration)")
        hot_fraction = tier["hot_fraction"] if config.hot_fraction is None else config.hot_fraction
        self.hot_config = HotnessConfig(decay=tier["decay"] if config.hot_decay is None else config.hot_decay,
                                        sink_pages=tier["sink_pages"], recent_pages=tier["recent_pages"],
                                        hot_fraction=hot_fraction, max_hot_pages=config.hot_pages)
        n, ps = cache.num_pages, cache.page_size
        target = HotnessPolicy(self.hot_config, 0).target_hot(n)
        headroom = config.max_batch * (tier["sink_pages"] + tier["recent_pages"]) + \
            math.ceil(config.max_tokens_per_step / ps) + config.max_batch
        num_hot = max(1, min(n, target + headroom))
        self.tiers = TierConfig(num_cold_pages=max(1, n - target), k_granularity=tier["k_granularity"],
                                v_granularity=tier["v_granularity"], scales=config.kv_scales,
                                cold_format=tier.get("cold_format", "int8"), group_size=tier.get("group_size", 0),
                                int8_layers=tier.get("int8_layers") or ())
        dims = (package.num_layers, package.num_kv_heads, package.head_dim)
        static = _static_scales(package) if config.kv_scales == "static" else None
        # INT4 cold keys of the layers whose node reads key_sub_bounds quantize on them (format 3)
        two_level = [i for i, layer in enumerate(package.layers) if SUB_ROLES[0] in layer]
        self.pool = TieredPagePool(replace(cache, num_pages=num_hot), self.tiers, *dims, static_scales=static,
                                   two_level_layers=two_level)
        self.policy = HotnessPolicy(self.hot_config, self.pool.num_pages)
        self.hot_page_bytes = CacheConfig.page_bytes(ps, *dims, cache.dtype)
        self.cold_page_bytes = cold_page_bytes(self.tiers, ps, *dims, cache.dtype)  # summed over per-layer codecs
        self.demoted = self.promoted = 0
        self.peak = dict(kv_bytes=0, kv_bytes_all_hot=0)

    def observe(self, batch, selected_pages: list[np.ndarray] | None, layers: list[int]) -> None:
        """Count one step's selections of ``layers`` (the sparse ones), decode rows only:
        a prefill row attends every page, which says nothing about which matter."""
        if selected_pages is None or len(batch) == 0:
            return
        sel = np.stack([selected_pages[i] for i in layers])  # [layers, B, Hkv, NP]
        decode = (batch.num_new_tokens == 1) & (batch.past_lens > 0)
        in_use = np.where(decode, -(-batch.past_lens // self.pool.page_size), 0)
        self.policy.observe(sel, batch.page_table, in_use)

    def rebalance(self, holders: list[list[int]]) -> list[int]:
        """Demote what the policy plans (between steps), else promote into the room under the
        target; returns the demoted handles."""
        done = self.policy.rebalance(self.pool, holders)
        self.demoted += len(done)
        if not done:
            self.promoted += len(self.policy.promote(self.pool))
        now = self.kv_bytes()
        for key in self.peak:
            self.peak[key] = max(self.peak[key], now[key])
        return done

    def kv_bytes(self) -> dict:
        """Bytes of the live pages (hot + cold, all layers) now, and what they would take all hot."""
        hot, cold = len(self.pool.hot_pages()), len(self.pool.cold_pages())
        return dict(kv_bytes=hot * self.hot_page_bytes + cold * self.cold_page_bytes,
                    kv_bytes_all_hot=(hot + cold) * self.hot_page_bytes)

    def stats(self) -> dict:
        pool = self.pool
        return dict(hot_fraction=self.hot_config.hot_fraction, kv_scales=self.tiers.scales, hot_slots=pool.num_hot,
                    cold_slots=pool.num_cold,
                    pages_hot=len(pool.hot_pages()), pages_cold=len(pool.cold_pages()), pages_demoted=self.demoted,
                    pages_promoted=self.promoted, cold_format=self.tiers.cold_format,
                    int8_layers=list(self.tiers.int8_layers), cold_formats=self.tiers.describe(),
                    **self.kv_bytes(), peak_kv_bytes=self.peak["kv_bytes"],
                    peak_kv_bytes_all_hot=self.peak["kv_bytes_all_hot"])


def _static_scales(package) -> tuple[np.ndarray, np.ndarray]:
    """The calibration's static K/V scales, from the artifact the package carries."""
    cal = package.cold_tier.get("calibration")
    if not cal:
        raise ValueError(f"{package.path}: static KV scales need a package exported with --calibration "
                         "(this one has default cold-tier settings and no calibration ranges)")
    artifact = CalibrationArtifact.load(package.path / cal["file"])
    k, v = artifact.static_scales()
    if k.shape[:2] != (package.num_layers, package.num_kv_heads) or k.shape[3] != package.head_dim:
        raise ValueError(f"{package.path / cal['file']}: calibration ranges {k.shape} do not fit the model")
    return k, v
