"""The calibration artifact an export reads (``--calibration``) and ships in the package.

``tinyserve-calibrate`` writes it (``contracts.calibration.CalibrationArtifact``:
JSON + npz); the export checks it fits before minutes of work
(:func:`load_calibration`) and copies it into the package as its last step
(:func:`with_calibration`), where the runtime loads it.
"""

from __future__ import annotations

from pathlib import Path

from ..contracts.calibration import ArtifactError, CalibrationArtifact
from ..contracts.manifest import CALIBRATION_FILE, Manifest
from .config import ExportConfig
from .errors import InputError


def load_calibration(config: ExportConfig) -> CalibrationArtifact | None:
    """The calibration artifact of ``config``, None without one; InputError naming the problem
    (unreadable, or calibrated with another page size than the export's)."""
    if config.calibration is None:
        return None
    try:
        artifact = CalibrationArtifact.load(config.calibration)
    except ArtifactError as e:
        raise InputError(str(e)) from None
    if artifact.page_size != config.resolved_page_size():
        raise InputError(f"{config.calibration} was calibrated with page size {artifact.page_size}, the export uses "
                         f"{config.resolved_page_size()}: pass --page-size {artifact.page_size}")
    return artifact


def with_calibration(finalize, artifact: CalibrationArtifact):
    """``finalize`` (a ``StagedPackage.commit`` hook), then a copy of the calibration artifact
    (JSON + npz) in the package's temporary folder."""
    def both(tmp: Path, manifest: Manifest) -> Manifest:
        manifest = finalize(tmp, manifest)
        artifact.save(tmp / CALIBRATION_FILE)
        return manifest

    return both
