"""The validation's bound: how far the rewritten model's logits may move from the source's.

A fixed bound does not fit every source: 1e-4 held SmolLM2 (float32 noise ~1e-5)
but not Qwen2.5-0.5B, whose own float32 noise is ~1e-4. So the bound is the
configured tolerance or ``NOISE_FACTOR`` x the source's own rounding noise, the
larger (:func:`validation_tolerance`); :func:`check_within` refuses a figure past it.
"""

from __future__ import annotations

from .config import ExportConfig
from .errors import ValidationError

NOISE_FACTOR = 4  # the rewrite may differ from the source by this many times the source's own noise


def validation_tolerance(config: ExportConfig, reference, manifest: dict) -> tuple[float, float | None]:
    """(the validation's max |logit diff| bound, the source's rounding noise): the configured
    tolerance, or ``NOISE_FACTOR`` x the noise of the source against itself (ORT optimizations on
    vs off: ``reference.noise``, a ``validate.SourceReference``) when that is larger. A
    half-precision source's logits are rounded to its dtype, so ``NOISE_FACTOR`` of its steps at
    the largest logit (``reference.logit_ulp``) bound it too (the noise reported is the larger of
    the two). An explicit ``validate_tolerance`` is used as given: the source is not run."""
    if config.validate_tolerance is not None:
        return config.validate_tolerance, None
    noise = max(reference.noise(manifest), reference.logit_ulp(manifest))
    return max(config.tolerance(), NOISE_FACTOR * noise), noise


def check_within(figure: float, tolerance: float, config: ExportConfig) -> None:
    """ValidationError (one line) unless ``figure <= tolerance`` (a NaN figure fails); it names
    the source's noise when that, not ``config.tolerance()``, set the bound."""
    if not figure <= tolerance:
        raise ValidationError(f"rewritten model differs from the original: max |logit diff| {figure:.3g} > "
                              f"{tolerance:.3g}" + (f" ({NOISE_FACTOR}x the source's own rounding noise)"
                                                    if tolerance > config.tolerance() else ""))
