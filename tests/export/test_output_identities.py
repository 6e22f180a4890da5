"""output_identities: the Identity copies that only name a graph output are gone, outputs unchanged."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tinyserve_trt.export.output_identities import DropOutputIdentities

ort = pytest.importorskip("onnxruntime")


def _model() -> onnx.ModelProto:
    """``new_key = Identity(Relu(x))`` (dropped); ``y = Neg(relu)`` reads the same value;
    ``passthru = Identity(x)`` (a graph input: kept); ``both``/``twice`` name one value twice (kept)."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["r"], ["new_key"]),
             helper.make_node("Neg", ["r"], ["y"]), helper.make_node("Identity", ["x"], ["passthru"]),
             helper.make_node("Abs", ["x"], ["both"]), helper.make_node("Identity", ["both"], ["twice"])]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B"]) for n in ("new_key", "y", "passthru", "both",
                                                                                  "twice")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B"])], outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _run(model: onnx.ModelProto) -> dict:
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([-1.5, 2.0, 0.0], np.float32)
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, {"x": x})))


def test_only_the_renaming_identity_goes_and_the_outputs_stay():
    import onnx_ir as ir

    model = _model()
    work, drop = ir.serde.deserialize_model(model), DropOutputIdentities()
    drop(work)
    out = ir.serde.serialize_model(work)
    onnx.checker.check_model(out)
    assert drop.dropped == 1
    assert [n.op_type for n in out.graph.node].count("Identity") == 2  # passthru and twice stay
    assert [o.name for o in out.graph.output] == [o.name for o in model.graph.output]
    made = {n.output[0]: n.op_type for n in out.graph.node}
    assert made["new_key"] == "Relu"
    before, after = _run(model), _run(out)
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)


def _renaming_identities(graph: onnx.GraphProto) -> list[str]:
    made = {o for n in graph.node for o in n.output}
    outs = {o.name for o in graph.output}
    return [n.output[0] for n in graph.node if n.op_type == "Identity" and n.output[0] in outs and n.input[0] in made]


def test_an_exports_ort_graph_names_its_kv_rows_without_copies(export_fixture, tmp_path):
    from tinyserve_trt.contracts.manifest import MODEL_FILE, ORT_GRAPH_FILE
    from tinyserve_trt.export.config import ExportConfig
    from tinyserve_trt.export.pipeline import export_model

    src = export_fixture("llama", "legacy_eager") / MODEL_FILE
    export_model(src, tmp_path / "pkg", ExportConfig(page_size=8, sub_page_size=4, dense_layers=1), quiet=True)
    portable = onnx.load(str(tmp_path / "pkg" / MODEL_FILE), load_external_data=False)
    graph = onnx.load(str(tmp_path / "pkg" / ORT_GRAPH_FILE), load_external_data=False)
    assert any(name.startswith("new_key") for name in _renaming_identities(portable.graph))  # what was dropped
    assert _renaming_identities(graph.graph) == []  # (the export validated this graph against the source)
    assert [o.name for o in graph.graph.output] == [o.name for o in portable.graph.output]
