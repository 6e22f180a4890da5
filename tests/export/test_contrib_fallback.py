"""The ORT graph keeps ORT's contrib fusions only when they validate.

SkipSimplifiedLayerNormalization and RotaryEmbedding round differently from the
standard-op graph they replace (SmolLM2: max |logit diff| 4.3e-5 -> 6.9e-5 of the
1e-4 tolerance). A model where that rounding alone crosses the tolerance must
still export - with the standard ops - instead of failing validation.
"""

from __future__ import annotations

import json

import onnx
import pytest

from tinyserve_trt.contracts.manifest import ORT_GRAPH_FILE
from tinyserve_trt.cpu.native import LAYER_OP_TYPE
from tinyserve_trt.export import pipeline
from tinyserve_trt.export.config import ExportConfig
from tinyserve_trt.export.pipeline import export_model

CONTRIB = {"SkipSimplifiedLayerNormalization", "RotaryEmbedding"}
ROTARY_LAYER = "RotaryEmbedding (in the native layer node)"  # native_layer.py folds a fused rotary into it


def _fused(nodes) -> set[str]:
    """The contrib fusions a graph's nodes hold: contrib nodes, and the rotaries the native layer
    nodes took over (their rotary_positions input is set)."""
    out = {n.op_type for n in nodes} & CONTRIB
    if any(n.op_type == LAYER_OP_TYPE and len(n.input) > 3 and n.input[3] for n in nodes):
        out.add(ROTARY_LAYER)
    return out


def _contrib_ops(path) -> set[str]:
    return _fused(onnx.load(str(path), load_external_data=False).graph.node)


def _export(export_fixture, tmp_path):
    src = export_fixture("llama", "legacy_eager") / "model.onnx"
    export_model(src, tmp_path / "pkg", ExportConfig(page_size=4, dense_layers=1), quiet=True)
    manifest = json.loads((tmp_path / "pkg" / "tinyserve.json").read_text())
    return tmp_path / "pkg", {**manifest["validation"], "plan": manifest["ort_optimized"]["plan"]}


def test_contrib_fusions_are_kept_when_they_validate(export_fixture, tmp_path):
    pkg, validation = _export(export_fixture, tmp_path)
    assert validation["plan"]["contrib_fusions"] is True and validation["plan"]["fusions_why"] is None
    assert _contrib_ops(pkg / ORT_GRAPH_FILE)  # the tiny LLaMA's rotaries at least


def test_contrib_fusions_that_fail_validation_are_dropped(export_fixture, tmp_path, monkeypatch):
    real = pipeline._validate

    def rounding_past_tolerance(original_bytes, proto, manifest):  # as if the fused kernels rounded badly
        figure = real(original_bytes, proto, manifest)
        fused = bool(_fused(proto.graph.node))
        return figure + (1.0 if fused else 0.0)

    monkeypatch.setattr(pipeline, "_validate", rounding_past_tolerance)
    pkg, validation = _export(export_fixture, tmp_path)
    assert validation["plan"]["contrib_fusions"] is False
    assert validation["plan"]["fusions_why"].startswith("ORT contrib fusions give max |logit diff| ")
    assert validation["max_abs_logit_diff"] <= validation["tolerance"]
    assert _contrib_ops(pkg / ORT_GRAPH_FILE) == set()
