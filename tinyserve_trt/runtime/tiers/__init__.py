"""The INT8 cold tier (issue #6), one concept per module.

config    TierConfig (size, granularities, scales) and what a cold page costs
pool      TieredPagePool: page handles bound to hot or cold physical slots
hotness   HotnessConfig / HotnessPolicy: which pages stay hot, from the op's selections
tiering   Tiering: the engine's side - sizes the pool, feeds the policy, demotes between steps
"""

from tinyserve_trt.runtime.tiers.config import SCALES, TierConfig, cold_page_bytes
from tinyserve_trt.runtime.tiers.hotness import HotnessConfig, HotnessPolicy
from tinyserve_trt.runtime.tiers.pool import TieredPagePool
from tinyserve_trt.runtime.tiers.tiering import Tiering

__all__ = ["SCALES", "HotnessConfig", "HotnessPolicy", "TierConfig", "TieredPagePool", "Tiering",
           "cold_page_bytes"]
