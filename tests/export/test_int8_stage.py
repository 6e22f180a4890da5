"""The INT8-layer pick as a stage over the written package (issue #32): the export runs once (it
no longer exports an all-INT4 probe package and then itself again), the stage retypes the picked
layers in the staging folder, and a failing stage leaves a previous package at OUTDIR untouched.
What the pass picks is ``test_auto_int8.py``'s."""

from __future__ import annotations

import json

import onnx
import pytest

from tinyserve_trt.contracts.manifest import MANIFEST_FILE, MODEL_FILE, Manifest
from tinyserve_trt.export import pipeline
from tinyserve_trt.export.auto_int8 import apply_int8_layers
from tinyserve_trt.export.config import ExportConfig
from tinyserve_trt.export.errors import UnsupportedError
from tinyserve_trt.ops import schema
from tinyserve_trt.ops.node import node_attributes

BASE = dict(page_size=4, token_budget=16, dense_layers=1, cold_pages=True, validate=False)


def test_the_export_runs_once_and_the_stage_retypes_the_picked_layer(llama, tmp_path, monkeypatch):
    from tinyserve_trt.calibration import int8_pick

    calls = []
    real = pipeline._export
    monkeypatch.setattr(pipeline, "_export", lambda *a, **k: (calls.append(a[1]), real(*a, **k))[1])
    monkeypatch.setattr(int8_pick, "pick_int8_layers", lambda folder: int8_pick.Int8Pick((1,), [0.1, 0.9], 2, 9))
    report = pipeline.export_model(llama[0], tmp_path / "pkg", ExportConfig(**BASE), quiet=True)
    assert len(calls) == 1  # one export: no probe package, no re-entry
    manifest = json.loads((tmp_path / "pkg" / MANIFEST_FILE).read_text())
    assert manifest["cold_tier"]["int8_layers"] == [1] and report.int8_layers == (1,)
    assert manifest["cold_tier"]["int8_layers_kl"] == [0.1, 0.9] and "int8 layers" in report.seconds
    for name in (MODEL_FILE, manifest["ort_optimized"]["file"]):  # the portable model and the ORT graph agree
        model = onnx.load(str(tmp_path / "pkg" / name), load_external_data=False)
        kinds = {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.input}
        assert [kinds[layer["key_cache_int8"]] for layer in manifest["io"]["layers"]] == [
            onnx.TensorProto.UINT8, onnx.TensorProto.INT8]
    nodes = [n for n in onnx.load(str(tmp_path / "pkg" / MODEL_FILE), load_external_data=False).graph.node
             if n.op_type == schema.OP_TYPE]
    assert [node_attributes(n).cold_format for n in nodes] == ["int4", "int8"]
    assert [schema.overload_cold_format(n.overload) for n in nodes] == ["int4", "int8"]
    from tinyserve_trt import LLM, SamplingParams

    out = LLM(tmp_path / "pkg", max_batch=1).generate(prompt_token_ids=[list(range(3, 30))],
                                                       params=SamplingParams(temperature=0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_failing_stage_leaves_the_previous_package(llama, tmp_path, monkeypatch):
    from tinyserve_trt.calibration import int8_pick

    pkg = tmp_path / "pkg"
    pipeline.export_model(llama[0], pkg, ExportConfig(**{**BASE, "int8_layers": "none"}), quiet=True)
    before = {p.name: p.read_bytes() for p in pkg.iterdir() if p.is_file()}

    def broken(folder):
        raise RuntimeError("no memory")

    monkeypatch.setattr(int8_pick, "pick_int8_layers", broken)
    with pytest.raises(UnsupportedError, match="picking INT8 layers failed"):
        pipeline.export_model(llama[0], pkg, ExportConfig(**BASE), overwrite=True, quiet=True)
    assert {p.name: p.read_bytes() for p in pkg.iterdir() if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]  # the staging folder is gone


def test_the_stage_refuses_a_package_that_is_not_all_int4(llama, tmp_path):
    pkg = tmp_path / "pkg"
    pipeline.export_model(llama[0], pkg, ExportConfig(**{**BASE, "int8_layers": (0,)}), quiet=True)
    with pytest.raises(ValueError, match="all INT4"):
        apply_int8_layers(pkg, Manifest.load(pkg), (1,), "test")
