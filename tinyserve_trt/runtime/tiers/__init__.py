"""The INT8 cold tier (issue #6), one concept per module.

pool      TieredPagePool: page handles bound to hot or cold physical slots
hotness   HotnessPolicy: which pages stay hot, from the op's selections
tiering   Tiering: the engine's side - sizes the pool, feeds the policy, demotes between steps

Their configs (``TierConfig``, ``HotnessConfig``, ``cold_page_bytes``) are
shared with export and calibration, so they live in ``contracts.cold_tier``;
they are re-exported here for the runtime's users.
"""

from tinyserve_trt.contracts.cold_tier import SCALES, HotnessConfig, TierConfig, cold_page_bytes
from tinyserve_trt.runtime.tiers.hotness import HotnessPolicy
from tinyserve_trt.runtime.tiers.pool import TieredPagePool
from tinyserve_trt.runtime.tiers.tiering import Tiering

__all__ = ["SCALES", "HotnessConfig", "HotnessPolicy", "TierConfig", "TieredPagePool", "Tiering",
           "cold_page_bytes"]
