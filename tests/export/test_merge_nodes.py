"""MergeIdenticalNodes: duplicate per-step nodes collapse, If branches follow the rename,
graph outputs keep their names, and the outputs do not change."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from tinyserve_trt.export.merge_nodes import MergeIdenticalNodes

ort = pytest.importorskip("onnxruntime")


def _model() -> onnx.ModelProto:
    """Two "layers" each computing n = past + 1 (identical) and reading it, one of them inside an
    If branch (outer scope); a third copy of n is a graph output."""
    one = numpy_helper.from_array(np.array(1, np.int64), "one")
    then_g = helper.make_graph([helper.make_node("Mul", ["x", "n1f"], ["t_out"])], "then", [],
                               [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Sub", ["x", "n1f"], ["e_out"])], "else", [],
                               [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, None)])
    nodes = [
        helper.make_node("Add", ["past", "one"], ["n0"]),
        helper.make_node("Cast", ["n0"], ["n0f"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["x", "n0f"], ["y0"]),
        helper.make_node("Add", ["past", "one"], ["n1"]),  # the same as n0
        helper.make_node("Cast", ["n1"], ["n1f"], to=TensorProto.FLOAT),  # then the same as n0f
        helper.make_node("Greater", ["past", "one"], ["cond"]),
        helper.make_node("If", ["cond"], ["y1"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Add", ["past", "one"], ["n_out"]),  # a graph output: kept
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
                     helper.make_tensor_value_info("past", TensorProto.INT64, [])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in ("y0", "y1")]
        + [helper.make_tensor_value_info("n_out", TensorProto.INT64, [])], [one])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _apply(proto: onnx.ModelProto, pass_) -> onnx.ModelProto:
    model = ir.serde.deserialize_model(proto)
    pass_(model)
    return ir.serde.serialize_model(model)


@pytest.mark.parametrize("past", [0, 4])
def test_duplicates_merge_and_subgraphs_follow(past):
    model = _model()
    merged = _apply(model, MergeIdenticalNodes())
    assert len(model.graph.node) - len(merged.graph.node) == 2  # n1 and n1f; n_out is a graph output
    onnx.checker.check_model(merged, full_check=True)
    branch_reads = {i for a in next(n for n in merged.graph.node if n.op_type == "If").attribute for n in a.g.node
                    for i in n.input}
    assert "n0f" in branch_reads and "n1f" not in branch_reads
    assert [o.name for o in merged.graph.output] == [o.name for o in model.graph.output]
    feeds = {"x": np.arange(3, dtype=np.float32), "past": np.array(past, np.int64)}
    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)

    for want, got in zip(run(model), run(merged)):
        np.testing.assert_array_equal(got, want)


def test_dead_node_removal_keeps_what_only_a_branch_reads():
    model = _model()  # n1f is read by the If's branches only
    kept = _apply(model, RemoveUnusedNodesPass())
    assert "n1f" in {o for n in kept.graph.node for o in n.output} and len(kept.graph.node) == len(model.graph.node)
