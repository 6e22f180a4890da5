"""Export fixtures: tiny HF models exported in every exporter style.

``export_fixture(kind, style)`` returns the directory holding ``model.onnx``,
``config.json`` and ``fixture.json``. Each (kind, style) is exported at most
once per session into a session tmp dir (the whole 3 x 4 matrix takes ~35 s
on 2 cores); set ``TINYSERVE_FIXTURE_DIR`` to a persistent directory to reuse
exports across sessions (they are regenerated when ``fixture.json`` is
missing). ``optimum_fixture_dir`` is the checked-in optimum-cli export.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="session")
def export_fixture(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tinyserve_dev.models.tiny_models import export_tiny

    env = os.environ.get("TINYSERVE_FIXTURE_DIR")
    root = Path(env) if env else tmp_path_factory.mktemp("export_fixtures")

    def get(kind: str, style: str) -> Path:
        out = root / kind / style
        if not (out / "fixture.json").is_file() or not (out / "model.onnx").is_file():
            export_tiny(kind, style, out)
        return out

    return get


@pytest.fixture(scope="session")
def optimum_fixture_dir() -> Path:
    return FIXTURES / "optimum_gpt2"
