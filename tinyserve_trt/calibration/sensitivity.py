"""Layer sensitivity to INT4 cold pages: which layers an INT4 package keeps at INT8 (issue #17).

Per held-out prompt, the cold pages are the ones the runtime would pick
(``observe.heldout_cold_pages``); for each layer ``l`` the next-token distribution
with only layer ``l``'s cold pages INT4 (format 3, keys on the page bounds or, in a
two-level layer, its sub-page codes: ``observe.fake_quantize``) is compared with the
all-hot one. ``layer_kl[l]`` is the mean KL(all hot || only ``l`` INT4) over the prompts;
the ``int8_layers_count`` largest are the artifact's ``int8_layers``, which
``tinyserve-export --calibration`` applies.

Cost: ``L + 1`` forwards per prompt (plus the selection replay), so it runs on the
held-out prompts only, never the calibration set.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tinyserve_trt.calibration.observe import (CalibrationConfig, Progress, _no_progress, fake_quantize,
                                               heldout_cold_pages, kl_divergence)
from tinyserve_trt.calibration.source import ObservationSource


# next tokens measured per prompt (its last ones): one is noise - on SmolLM2 2 docs prompts x 1 position
# ranked layers 0,3,6 and another 2 ranked 8,17,20 - while 8 per prompt find 18 first, as
# benchmarks/results/int4_layer_sensitivity.md does
SENSITIVITY_POSITIONS = 8


def layer_sensitivity(source: ObservationSource, prompts: Sequence[Sequence[int]], cfg: CalibrationConfig,
                      progress: Progress = _no_progress, positions: int = SENSITIVITY_POSITIONS) -> list[float]:
    """``[L]`` mean KL(all hot || only this layer's cold pages INT4) over ``prompts`` (token ids) and
    the next token at each of their last ``positions`` tokens (the cold pages: those of the context
    before the first of them). One position is a noisy estimate - a confident next token has KL ~0
    whatever the layer - so both tinyserve-calibrate and the export's own pass (``int8_pick.py``)
    average ``SENSITIVITY_POSITIONS``.
    Prompts too short to have a full cold page contribute 0 to every layer."""
    if cfg.cold_format != "int4":
        raise ValueError(f"the layer sensitivity pass measures INT4 cold pages; cold_format is {cfg.cold_format!r}")
    L = source.num_layers
    codecs = cfg.tiers().layer_codecs(L)  # every layer INT4: what keeping it at INT8 would avoid
    total = np.zeros(L, np.float64)
    for ids in progress(prompts, "layer sensitivity"):
        n = min(positions, len(ids) - 1)
        cold = heldout_cold_pages(source, ids[:len(ids) - n + 1], cfg) if n >= 1 else []
        if not cold:
            continue
        transforms = [None] + [fake_quantize(cfg, cold, codecs, layers=[layer]) for layer in range(L)]
        base, *ones = source.tail_logits_many(ids, transforms, n)
        for layer, one in enumerate(ones):
            total[layer] += np.mean([kl_divergence(b, o) for b, o in zip(base, one)])
    return (total / max(len(prompts), 1)).tolist()


def most_sensitive(layer_kl: Sequence[float], count: int) -> list[int]:
    """The ``count`` layers of largest KL, sorted by index (ties: the lower layer first)."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    order = sorted(range(len(layer_kl)), key=lambda i: (-layer_kl[i], i))
    return sorted(order[:count])
