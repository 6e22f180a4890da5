"""Residual Add + RMSNorm -> com.microsoft::SkipSimplifiedLayerNormalization (ORT graph only).

The graphs are the legacy LLaMA export's norm shape (Cast, Pow, ReduceMean, Add eps, Sqrt,
Div 1/x or Reciprocal, Mul, Cast, Mul by the weight), after a residual Add whose sum the
next block reads too; both ReduceMean forms (opset 17 ``axes`` attribute, opset 18+ input).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tinyserve_trt.export.ort_graph import prepared_graph

ort = pytest.importorskip("onnxruntime")
D = 8
EPS = 1e-5


def _norm(nodes, inits, opset, tag, s, out, *, reciprocal=False, weight_first=True, exponent=2.0):
    """RMSNorm of ``s`` into ``out`` as torch's legacy export writes it."""
    x = f"{tag}_x"
    nodes += [helper.make_node("Cast", [s], [x], to=TensorProto.FLOAT),
              helper.make_node("Constant", [], [f"{tag}_two"], value=numpy_helper.from_array(np.float32(exponent))),
              helper.make_node("Pow", [x, f"{tag}_two"], [f"{tag}_sq"])]
    if opset >= 18:
        inits.append(numpy_helper.from_array(np.array([-1], np.int64), f"{tag}_axes"))
        nodes.append(helper.make_node("ReduceMean", [f"{tag}_sq", f"{tag}_axes"], [f"{tag}_ms"], keepdims=1))
    else:
        nodes.append(helper.make_node("ReduceMean", [f"{tag}_sq"], [f"{tag}_ms"], axes=[-1], keepdims=1))
    inits += [numpy_helper.from_array(np.float32(EPS), f"{tag}_eps"),
              numpy_helper.from_array(np.float32(1.0), f"{tag}_one"),
              numpy_helper.from_array(np.linspace(0.5, 1.5, D).astype(np.float32), f"{tag}_w")]
    nodes += [helper.make_node("Add", [f"{tag}_ms", f"{tag}_eps"], [f"{tag}_mse"]),
              helper.make_node("Sqrt", [f"{tag}_mse"], [f"{tag}_rms"])]
    if reciprocal:
        nodes.append(helper.make_node("Reciprocal", [f"{tag}_rms"], [f"{tag}_r"]))
    else:
        nodes.append(helper.make_node("Div", [f"{tag}_one", f"{tag}_rms"], [f"{tag}_r"]))
    nodes += [helper.make_node("Mul", [x, f"{tag}_r"], [f"{tag}_n"]),
              helper.make_node("Cast", [f"{tag}_n"], [f"{tag}_nc"], to=TensorProto.FLOAT),
              helper.make_node("Mul", [f"{tag}_w", f"{tag}_nc"] if weight_first else [f"{tag}_nc", f"{tag}_w"], [out])]


def _model(opset: int, *, bias: bool = False, exponent: float = 2.0) -> onnx.ModelProto:
    """y = norm2(s2) + s2, s2 = s1 + norm1(s1) @ W, s1 = inp + h (or inp + a constant bias)."""
    nodes, inits = [], [numpy_helper.from_array(np.eye(D, dtype=np.float32)[::-1] * 0.5, "W")]
    if bias:
        inits.append(numpy_helper.from_array(np.arange(D, dtype=np.float32), "bias"))
    nodes.append(helper.make_node("Add", ["inp", "bias" if bias else "h"], ["s1"]))
    _norm(nodes, inits, opset, "n1", "s1", "y1", exponent=exponent)
    nodes += [helper.make_node("MatMul", ["y1", "W"], ["m1"]), helper.make_node("Add", ["s1", "m1"], ["s2"])]
    _norm(nodes, inits, opset, "n2", "s2", "y2", reciprocal=True, weight_first=False, exponent=exponent)
    nodes.append(helper.make_node("Add", ["y2", "s2"], ["y"]))
    inputs = [helper.make_tensor_value_info("inp", TensorProto.FLOAT, ["B", "S", D])]
    if not bias:
        inputs.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, ["B", "S", D]))
    graph = helper.make_graph(nodes, "skip_norm", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", D])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _run(model, feeds):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _feeds(rng, model):
    return {i.name: rng.standard_normal((2, 3, D)).astype(np.float32) for i in model.graph.input}


@pytest.mark.parametrize("opset", [17, 21])
def test_residual_add_and_rms_norm_become_one_skip_norm(rng, opset):
    model = _model(opset)
    fused = prepared_graph(model)
    ops = [(n.domain, n.op_type) for n in fused.graph.node]
    assert ops.count(("com.microsoft", "SkipSimplifiedLayerNormalization")) == 2, ops
    assert not {"Pow", "ReduceMean", "Sqrt"} & {op for _, op in ops}
    assert [op for _, op in ops].count("Add") == 1  # the final y2 + s2 (reads the fused node's sum)
    eps = [helper.get_attribute_value(a) for n in fused.graph.node for a in n.attribute if a.name == "epsilon"]
    assert eps == [pytest.approx(EPS)] * 2
    assert any(o.domain == "com.microsoft" for o in fused.opset_import)
    feeds = _feeds(rng, model)
    np.testing.assert_allclose(_run(fused, feeds), _run(model, feeds), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs", [dict(bias=True), dict(exponent=3.0)], ids=["constant_operand", "not_a_square"])
def test_other_adds_and_norms_are_left_alone(rng, kwargs):
    model = _model(17, **kwargs)
    fused = prepared_graph(model)
    ops = [n.op_type for n in fused.graph.node]
    if "bias" in kwargs:  # the bias Add stays; the second block (a residual of two activations) fuses
        assert ops.count("SkipSimplifiedLayerNormalization") == 1 and ops.count("Pow") == 1
    else:
        assert "SkipSimplifiedLayerNormalization" not in ops and ops.count("Pow") == 2
    feeds = _feeds(rng, model)
    np.testing.assert_allclose(_run(fused, feeds), _run(model, feeds), rtol=1e-5, atol=1e-5)
