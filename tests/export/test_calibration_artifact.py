"""The --calibration artifact in an export (export/calibration_artifact.py): read and checked
against the export's page size before any work, copied into the package after ``finalize``.
(The CLI's exit-2 lines for the same refusals: tests/export/test_cold_tier.py.)"""

from __future__ import annotations

import pytest

from tests.tiny_models import write_calibration
from tinyserve_trt.contracts.calibration import CalibrationArtifact
from tinyserve_trt.contracts.manifest import CALIBRATION_FILE
from tinyserve_trt.export.calibration_artifact import load_calibration, with_calibration
from tinyserve_trt.export.config import ExportConfig
from tinyserve_trt.export.errors import InputError

MANIFEST = dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, token_budget=16)


def test_no_calibration_loads_nothing():
    assert load_calibration(ExportConfig(page_size=4)) is None


def test_a_fitting_artifact_loads_and_a_misfit_or_unreadable_one_is_an_input_error(tmp_path):
    path = write_calibration(tmp_path / "cal.json", MANIFEST)
    assert load_calibration(ExportConfig(page_size=4, calibration=str(path))).page_size == 4
    with pytest.raises(InputError, match="calibrated with page size 4, the export uses 8: pass --page-size 4"):
        load_calibration(ExportConfig(page_size=8, calibration=str(path)))
    with pytest.raises(InputError):
        load_calibration(ExportConfig(page_size=4, calibration=str(tmp_path / "missing.json")))


def test_with_calibration_runs_finalize_first_then_ships_the_artifact(tmp_path):
    artifact = CalibrationArtifact.load(write_calibration(tmp_path / "cal.json", MANIFEST))
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    seen = []

    def finalize(tmp, manifest):
        seen.append((tmp / CALIBRATION_FILE).exists())
        return {"finalized": manifest}

    assert with_calibration(finalize, artifact)(pkg, "m") == {"finalized": "m"}
    assert seen == [False]
    assert CalibrationArtifact.load(pkg / CALIBRATION_FILE).page_size == 4
