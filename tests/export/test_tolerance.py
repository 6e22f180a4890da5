"""The validation's bound (export/tolerance.py): the configured tolerance, or NOISE_FACTOR x the
source's own noise when larger; an explicit --validate-tolerance as given; the refusal's line."""

from __future__ import annotations

import pytest

from tinyserve_trt.export.config import ExportConfig
from tinyserve_trt.export.errors import ValidationError
from tinyserve_trt.export.tolerance import NOISE_FACTOR, check_within, validation_tolerance


class _Reference:
    """A source whose float32 noise and half-precision logit step are given."""

    def __init__(self, noise: float, ulp: float = 0.0):
        self._noise, self._ulp, self.runs = noise, ulp, 0

    def noise(self, manifest):
        self.runs += 1
        return self._noise

    def logit_ulp(self, manifest):
        return self._ulp


@pytest.mark.parametrize("noise, ulp, bound", [(1e-6, 0.0, 1e-4),  # quiet source: the configured 1e-4
                                               (1e-4, 0.0, NOISE_FACTOR * 1e-4),  # noisy float32 source
                                               (1e-6, 1e-3, NOISE_FACTOR * 1e-3)])  # fp16 logits' step
def test_the_bound_is_the_larger_of_the_tolerance_and_the_sources_noise(noise, ulp, bound):
    tolerance, reported = validation_tolerance(ExportConfig(), _Reference(noise, ulp), {})
    assert tolerance == pytest.approx(bound) and reported == max(noise, ulp)


def test_an_explicit_tolerance_is_used_as_given_without_running_the_source():
    reference = _Reference(1.0)
    assert validation_tolerance(ExportConfig(validate_tolerance=1e-3), reference, {}) == (1e-3, None)
    assert reference.runs == 0


def test_check_within_refuses_a_figure_past_the_bound_and_says_when_noise_set_it():
    config = ExportConfig()
    check_within(1e-4, 1e-4, config)  # at the bound: accepted
    with pytest.raises(ValidationError, match=r"max \|logit diff\| 0.0002 > 0.0001$"):
        check_within(2e-4, 1e-4, config)
    with pytest.raises(ValidationError, match=rf"\({NOISE_FACTOR}x the source's own rounding noise\)"):
        check_within(1e-3, 4e-4, config)
    with pytest.raises(ValidationError):
        check_within(float("nan"), 1e-4, config)
