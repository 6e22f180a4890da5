"""The manifest fields the export decides beside the rewrite: the cold tier (format, INT8 layers,
hot/cold policy, from a calibration artifact or the defaults) and two-level selection's."""

from __future__ import annotations

from ..contracts.calibration import CalibrationArtifact
from ..contracts.cold_tier import DEFAULT_HOT_FRACTION, INT4_GROUP_SIZE, HotnessConfig, TierConfig
from ..contracts.manifest import CALIBRATION_FILE, ColdTier
from ..ops import schema
from .config import ExportConfig
from .errors import InputError


def cold_tier_fields(config: ExportConfig, artifact: CalibrationArtifact | None, num_layers: int,
               dims: dict, int8_pick=None) -> ColdTier:
    """The manifest's ``cold_tier``: granularities, hot/cold policy parameters (the calibration's,
    else the runtime defaults), the INT8 layers (``int8_pick``: the export's own sensitivity pass)
    and where they came from."""
    if artifact is None:  # the cold format's default hot share (contracts.cold_tier.DEFAULT_HOT_FRACTION)
        tiers, hot = TierConfig(), HotnessConfig(hot_fraction=DEFAULT_HOT_FRACTION[config.resolved_cold_format])
        grans, source = (tiers.k_granularity, tiers.v_granularity), None
    else:
        want = (num_layers, dims["kv_heads"], dims["head_dim"])
        if artifact.k_absmax.shape != want:
            raise InputError(f"{config.calibration} is for a model with [layers, kv heads, head dim] "
                             f"{list(artifact.k_absmax.shape)}, this one has {list(want)}")
        hot = artifact.hotness_config()
        grans = (artifact.k_granularity, artifact.v_granularity)
        source = dict(file=CALIBRATION_FILE, model=artifact.model, policy=artifact.policy,
                      token_budget=artifact.token_budget, num_prompts=artifact.num_prompts,
                      evaluation=artifact.evaluation)
    # the op reads its own sinks / recent pages every step: never demote fewer than it keeps
    fmt = config.resolved_cold_format
    k_gran = "channel" if fmt == "int4" else grans[0]  # INT4 keys: per channel on the page bounds (cold_codec)
    try:
        measured = None if int8_pick is None else (int8_pick.layers, int8_pick.describe())
        int8_layers, where = config.resolved_int8_layers(num_layers, None if artifact is None else artifact.int8_layers,
                                                         measured)
    except ValueError as e:
        raise InputError(str(e)) from None
    return ColdTier(inputs=list(schema.COLD_INPUTS), cold_format=fmt, int8_layers=list(int8_layers),
                    int8_layers_source=where if fmt == "int4" else None,
                    int8_layers_kl=list(int8_pick.layer_kl) if int8_pick is not None and fmt == "int4" else None,
                    group_size=INT4_GROUP_SIZE if fmt == "int4" else 0, k_granularity=k_gran, v_granularity=grans[1],
                    hot_fraction=hot.hot_fraction, sink_pages=max(hot.sink_pages, config.sink_pages),
                    recent_pages=max(hot.recent_pages, config.recent_pages), decay=hot.decay, calibration=source)


def two_level_fields(plans, config: ExportConfig) -> dict:
    """Manifest fields of two-level selection (issue #15): the runtime pools keep ``key_sub_bounds``
    of this sub-page size; nothing for a single-level package."""
    two_level = [p.attrs for p in plans if p.attrs.two_level]
    return dict(sub_page_size=two_level[0].sub_page_size, candidate_share=config.candidate_share) if two_level else {}


__all__ = ["cold_tier_fields", "two_level_fields"]
