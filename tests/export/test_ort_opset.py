"""model.ort.onnx is raised to ai.onnx opset 21 so the two-level fine score uses blocked DequantizeLinear.

The tiny fixtures are opset 17 (torch's legacy exporter), like SmolLM2's source:
their portable model.onnx stays at 17, the ORT graph goes to 21 when it validates -
densely against the source and, with selection on, against the opset-17 ORT graph -
and stays at 17 with a one-line note when conversion or validation fails.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tinyserve_trt.contracts.manifest import MANIFEST_FILE, MODEL_FILE, ORT_GRAPH_FILE
from tinyserve_trt.export import pipeline
from tinyserve_trt.export.config import ExportConfig
from tinyserve_trt.export.ort_graph import prepared_graph
from tinyserve_trt.export.ort_opset import ORT_OPSET, OpsetRaiseError, raise_opset
from tinyserve_trt.export.pipeline import export_model
from tinyserve_trt.export.report import print_summary
from tinyserve_trt.export.validate import paged_logits, sparse_lengths
from tinyserve_trt.ops.node import make_op_model, onnx_opset
from tinyserve_trt.ops.schema import OpAttributes

# one two-level layer of two; the op as its function in model.ort.onnx (the raise is about its body:
# with the native kernel, the node replaces it - test_native_decode.py)
CONFIG = ExportConfig(page_size=8, sub_page_size=4, dense_layers=1, native_decode=False)


def _export(export_fixture, tmp_path, kind="llama", config=CONFIG):
    src = export_fixture(kind, "legacy_eager") / MODEL_FILE
    report = export_model(src, tmp_path / "pkg", config, quiet=True)
    return report, tmp_path / "pkg", json.loads((tmp_path / "pkg" / MANIFEST_FILE).read_text())


def _ops(graph: onnx.GraphProto, inside_if: bool = False) -> Counter:
    """op_type -> count, of the nodes inside If branches only when ``inside_if`` (the op's selection
    branch, where the fine score lives once inlined; the per-step candidate count's Floor is outside)."""
    out = Counter()
    for node in graph.node:
        if not inside_if:
            out[node.op_type] += 1
        for a in node.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                out += _ops(g)
    return out


def _blocked_dequantize(graph: onnx.GraphProto) -> int:
    count = 0
    for node in graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        count += node.op_type == "DequantizeLinear" and attrs.get("block_size", 0) > 0
        for a in node.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                count += _blocked_dequantize(g)
    return count


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def test_ort_graph_is_raised_and_the_fine_score_is_blocked_dequantize(export_fixture, tmp_path, capsys):
    report, pkg, manifest = _export(export_fixture, tmp_path)
    portable = onnx.load(str(pkg / MODEL_FILE), load_external_data=False)
    graph = onnx.load(str(pkg / ORT_GRAPH_FILE), load_external_data=False)
    assert onnx_opset(portable) == manifest["source"]["opset"] == 17  # what TensorRT parses is untouched
    plan = manifest["ort_optimized"]["plan"]
    assert onnx_opset(graph) == plan["opset"] == ORT_OPSET and plan["opset_why"] is None
    # the choices are the typed plan (contracts/ort_plan.py); validation holds only what was measured
    assert not {"ort_opset", "ort_opset_note", "ort_contrib_ops", "ort_native"} & set(manifest["validation"])
    assert manifest["validation"]["ort_opset_sparse_check"].startswith("max |logit diff| ")
    assert _blocked_dequantize(graph.graph) == 2  # code*step and hi*step of the one two-level layer
    assert _ops(graph.graph, inside_if=True)["Floor"] == 0  # the opset-17 form's hi = Floor(code / 16)
    assert (report.source_opset, report.ort_opset, report.ort_opset_note) == (17, ORT_OPSET, None)
    print_summary(report, CONFIG)
    assert f"ORT graph opset              {ORT_OPSET} (source 17)\n" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_raised_graph_equals_the_source_opset_graph(export_fixture, tmp_path, kind):
    _, pkg, manifest = _export(export_fixture, tmp_path, kind)
    proto = onnx.load(str(pkg / MODEL_FILE))
    old, new = prepared_graph(proto), prepared_graph(proto, opset=ORT_OPSET)
    assert (onnx_opset(old), onnx_opset(new)) == (17, ORT_OPSET)
    # the structure differs where the raise is meant to change it (so the test above can fail)
    assert _ops(old.graph, inside_if=True)["Floor"] > 0 and _blocked_dequantize(old.graph) == 0
    assert _blocked_dequantize(new.graph) == 2
    ps = manifest["page_size"]
    old_s, new_s = _session(old), _session(new)
    by_budget = {}
    for budget in (0, 3 * ps):  # dense, then selecting one page's worth of sub-pages by the fine score
        a, b = (paged_logits(s, manifest, budget, sparse_lengths(ps)) for s in (old_s, new_s))
        assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) <= CONFIG.tolerance()
        by_budget[budget] = a
    # the budget did select (decode steps follow the 2 prefill rows): the comparison ran the fine score
    assert max(float(np.abs(x - y).max()) for x, y in zip(by_budget[0][2:], by_budget[3 * ps][2:])) > 1e-3


def test_failed_conversion_keeps_the_source_opset_with_a_note(export_fixture, tmp_path, monkeypatch, capsys):
    def refuse(model, target):
        raise RuntimeError("no adapter for Foo 17 -> 18\nsecond line")

    monkeypatch.setattr(onnx.version_converter, "convert_version", refuse)
    report, pkg, manifest = _export(export_fixture, tmp_path)
    graph = onnx.load(str(pkg / ORT_GRAPH_FILE), load_external_data=False)
    note = manifest["ort_optimized"]["plan"]["opset_why"]
    assert onnx_opset(graph) == manifest["ort_optimized"]["plan"]["opset"] == 17
    assert note == report.ort_opset_note
    assert note.startswith(f"model.ort.onnx kept at ai.onnx opset 17 (not {ORT_OPSET}): OpsetRaiseError: ")
    assert "no adapter for Foo 17 -> 18" in note and "\n" not in note
    assert manifest["validation"]["max_abs_logit_diff"] <= manifest["validation"]["tolerance"]
    assert _blocked_dequantize(graph.graph) == 0 and _ops(graph.graph, inside_if=True)["Floor"] > 0
    print_summary(report, CONFIG)
    assert f"17 (source 17); {note}" in capsys.readouterr().out


def test_raised_graph_failing_validation_keeps_the_source_opset(export_fixture, tmp_path, monkeypatch):
    real = pipeline._validate

    def raised_rounds_badly(original_bytes, proto, manifest):
        return real(original_bytes, proto, manifest) + (1.0 if onnx_opset(proto) >= ORT_OPSET else 0.0)

    monkeypatch.setattr(pipeline, "_validate", raised_rounds_badly)
    _, pkg, manifest = _export(export_fixture, tmp_path)
    validation = manifest["validation"]
    assert manifest["ort_optimized"]["plan"]["opset"] == 17
    assert "its max |logit diff| 1 > 0.0001" in manifest["ort_optimized"]["plan"]["opset_why"]
    assert validation["max_abs_logit_diff"] <= validation["tolerance"]
    assert onnx_opset(onnx.load(str(pkg / ORT_GRAPH_FILE), load_external_data=False)) == 17


def test_unvalidated_export_falls_back_when_conversion_fails(export_fixture, tmp_path, monkeypatch):
    monkeypatch.setattr(onnx.version_converter, "convert_version",
                        lambda model, target: (_ for _ in ()).throw(ValueError("bad graph")))
    _, pkg, manifest = _export(export_fixture, tmp_path, config=ExportConfig(page_size=8, sub_page_size=4,
                                                                              dense_layers=1, validate=False))
    assert manifest["ort_optimized"]["plan"]["opset"] == 17 and manifest.get("validation") is None
    assert manifest["ort_optimized"]["plan"]["opset_why"].endswith("17 -> 21 failed: ValueError: bad graph")


def test_raise_opset_leaves_new_enough_models_and_its_input_alone(monkeypatch):
    model = make_op_model(attrs=OpAttributes(sub_page_size=4), opset=ORT_OPSET)
    assert raise_opset(model) is model
    old = make_op_model(attrs=OpAttributes(sub_page_size=4), opset=17)
    before = old.SerializeToString()
    raised = raise_opset(old)
    assert old.SerializeToString() == before
    assert onnx_opset(raised) == ORT_OPSET
    assert [f.opset_import[0].version for f in raised.functions] == [ORT_OPSET]  # the body rebuilt, not kept
    onnx.checker.check_model(raised, full_check=True)
    monkeypatch.setattr(onnx.version_converter, "convert_version",
                        lambda model, target: (_ for _ in ()).throw(RuntimeError("refused\nmore")))
    with pytest.raises(OpsetRaiseError, match=f"^onnx.version_converter 17 -> {ORT_OPSET} failed: RuntimeError: "
                                              "refused$"):
        raise_opset(old)
