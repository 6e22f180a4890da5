"""The built-in calibration text: package data (in the wheel), cut into prompts, and what
``tinyserve-calibrate`` reads without ``--data``."""

from __future__ import annotations

import tomllib
from fnmatch import fnmatch
from importlib import resources
from pathlib import Path

import pytest

from tinyserve_trt.calibration.default_text import DATA_FILE, PIECE_CHARS, default_prompts, default_text

ROOT = Path(__file__).resolve().parents[2]


def test_the_text_is_package_data_of_the_wheel():
    path = resources.files("tinyserve_trt.calibration").joinpath("data", DATA_FILE)
    assert path.is_file() and len(path.read_text(encoding="utf-8")) > 50_000
    # setuptools ships it only when package-data names it (the directory is not a package)
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch(f"data/{DATA_FILE}", pattern) for pattern in data["tinyserve_trt.calibration"])


def test_the_text_is_our_docs_not_an_evaluation_set():
    from tinyserve_dev.default_prompts import build

    text = default_text()
    assert "tinyserve" in text and "QueryAwareSparseAttention" in text
    for needle in ("To be, or not to be", "In the beginning God created", "import sys\n"):  # eval texts
        assert needle not in text
    # written by the generator from README.md + docs/*.md: every paragraph it had is still one of the docs'
    # (a regenerated file equals build(); an edited doc leaves the shipped snapshot valid until regenerated)
    docs = build(ROOT)
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    assert sum(p in docs for p in paragraphs) >= 0.9 * len(paragraphs)


def test_the_text_loads_into_prompts_of_whole_paragraphs():
    prompts = default_prompts()
    assert len(prompts) >= 2 and all(len(p) >= PIECE_CHARS for p in prompts)
    assert "\n\n".join(prompts) == "\n\n".join(p for p in default_text().split("\n\n") if p.strip())
    assert len(default_prompts(PIECE_CHARS * 2)) < len(prompts)
    with pytest.raises(ValueError, match="piece_chars must be positive"):
        default_prompts(0)


def test_calibrate_without_data_uses_the_built_in_text(tmp_path, llama, capsys):
    from tinyserve_trt.calibration.cli import main
    from tinyserve_trt.contracts.calibration import CalibrationArtifact

    cal = tmp_path / "cal.json"
    assert main([str(llama[1]), "--heldout", "2", "--max-tokens", "256", "--decode-steps", "3", "-o", str(cal),
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    art = CalibrationArtifact.load(cal)
    assert art.num_prompts == len(default_prompts()) - 2  # --samples: the pieces left after --heldout
    assert art.evaluation["num_prompts"] == 2 and len(art.layer_kl) == 2 and "held-out 2 prompts" in out
    with pytest.raises(SystemExit) as exc:  # more than the text holds: one line, exit 2
        main([str(llama[1]), "--samples", "100", "-o", str(cal), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "the built-in text holds" in err[0]


def test_calibrate_help_names_the_default():
    from tinyserve_trt.calibration.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "Default: the built-in text (tinyserve's own documentation" in text
