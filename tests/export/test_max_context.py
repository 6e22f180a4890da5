"""The context a package serves is the model's own, not SmolLM2's 8K (issue #30).

Before: ``ExportConfig.max_context`` was 8192 for every model, so a Qwen2.5 package (32K positions)
refused requests past 8K in the runtime (``limits.py`` reads the manifest's ``max_context``)."""

from __future__ import annotations

import json
import shutil

import pytest

from tinyserve_trt.export.config import (
    FALLBACK_MAX_CONTEXT,
    ExportConfig,
    model_max_context,
    resolve_max_context,
)

from .test_cli import run


def _with_config(src, dst, **fields):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst / "model.onnx"


def test_package_serves_the_models_context(capsys, tmp_path, export_fixture):
    src = _with_config(export_fixture("llama", "legacy_sdpa"), tmp_path / "src", max_position_embeddings=32768)
    got, out, err = run(capsys, src, "-o", tmp_path / "pkg", "--no-validate")
    assert got == 0, err
    assert json.loads((tmp_path / "pkg" / "tinyserve.json").read_text())["max_context"] == 32768
    assert "32768 tokens (the model's config.json)" in out
    got, out, err = run(capsys, src, "-o", tmp_path / "pkg2", "--no-validate", "--max-context", "1000")
    assert got == 0, err
    assert json.loads((tmp_path / "pkg2" / "tinyserve.json").read_text())["max_context"] == 1000


@pytest.mark.parametrize("config,want", [
    ({"max_position_embeddings": 131072}, 131072),
    ({"n_positions": 1024}, 1024),  # GPT-2
    ({"text_config": {"max_position_embeddings": 4096}}, 4096),  # multimodal wrappers
    ({"max_position_embeddings": True}, None),
    ({"max_position_embeddings": -1}, None),
    ({}, None),
])
def test_model_max_context_reads_config_json(tmp_path, config, want):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_max_context(tmp_path / "model.onnx") == want


def test_fallback_says_so(tmp_path):
    cfg, why = resolve_max_context(ExportConfig(), tmp_path / "model.onnx")
    assert cfg.max_context == FALLBACK_MAX_CONTEXT and "--max-context" in why
    (tmp_path / "config.json").write_text("{not json")
    assert resolve_max_context(ExportConfig(), tmp_path / "model.onnx")[0].max_context == FALLBACK_MAX_CONTEXT
    with pytest.raises(ValueError, match="max_context"):
        ExportConfig(max_context=0)
