"""rotate_half: the exporter's Slice/Slice/Neg/Concat becomes one MatMul, bit for bit.

The graphs are the legacy LLaMA export's rotary shape: the half width is a
literal, or computed from the input's Shape (as torch writes it; shared_shapes
folds that to constants first, as ``ort_graph.prepared_graph`` does).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tinyserve_trt.export.ort_graph import prepared_graph
from tinyserve_trt.export.rotate_half import rotation

ort = pytest.importorskip("onnxruntime")
D = 16


def _i64(name, *values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _model(half_from_shape: bool, shift: int = 0) -> onnx.ModelProto:
    """y = x * 2 + rotate_half(x) with x [B, H, S, D] an activation (x = in + 0); ``shift`` > 0
    moves the negated half's window left (``x[..., h - shift : D - shift]``): not rotate_half."""
    nodes = [helper.make_node("Add", ["inp", "zero"], ["x"])]
    if half_from_shape:  # torch: x.shape[-1] // 2
        nodes += [helper.make_node("Shape", ["x"], ["shape"]),
                  helper.make_node("Gather", ["shape", "three"], ["dim"], axis=0),
                  helper.make_node("Div", ["dim", "two"], ["half_s"]),
                  helper.make_node("Unsqueeze", ["half_s", "axis0"], ["half"])]
    else:
        nodes.append(helper.make_node("Constant", [], ["half"], value=_i64("h", D // 2)))
    nodes += [helper.make_node("Sub", ["half", "shift"], ["hi_start"]),
              helper.make_node("Slice", ["x", "hi_start", "hi_end", "last"], ["x2"]),
              helper.make_node("Neg", ["x2"], ["nx2"]),
              helper.make_node("Slice", ["x", "zero_i", "half", "last"], ["x1"]),
              helper.make_node("Concat", ["nx2", "x1"], ["rot"], axis=-1),
              helper.make_node("Add", ["x", "x"], ["x2x"]),
              helper.make_node("Add", ["x2x", "rot"], ["y"])]
    inits = [numpy_helper.from_array(np.zeros((), np.float32), "zero"), _i64("last", -1), _i64("shift", shift),
             _i64("hi_end", 2**62 if shift == 0 else D - shift), _i64("zero_i", 0),
             numpy_helper.from_array(np.array(3, np.int64), "three"),
             numpy_helper.from_array(np.array(2, np.int64), "two"), _i64("axis0", 0)]
    graph = helper.make_graph(nodes, "rot", [helper.make_tensor_value_info("inp", TensorProto.FLOAT, ["B", 3, "S", D])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 3, "S", D])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _run(model, x):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None,
                                                                                                   {"inp": x})[0]


def test_rotation_matrix_is_rotate_half(rng):
    x = rng.standard_normal((5, D)).astype(np.float32)
    np.testing.assert_array_equal(x @ rotation(D), np.concatenate([-x[:, D // 2:], x[:, :D // 2]], -1))


@pytest.mark.parametrize("half_from_shape", [False, True], ids=["literal", "from_shape"])
def test_rotate_half_becomes_one_matmul_bit_exact(rng, half_from_shape):
    model = _model(half_from_shape)
    fused = prepared_graph(model)
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("MatMul") == 1 and not {"Slice", "Neg", "Concat"} & set(ops), ops
    x = rng.standard_normal((2, 3, 4, D)).astype(np.float32)
    np.testing.assert_array_equal(_run(fused, x), _run(model, x))


def test_other_splits_are_left_alone(rng):
    model = _model(False, shift=1)  # concat(-x[..., 7:15], x[..., :8]): not rotate_half
    fused = prepared_graph(model)
    assert "MatMul" not in [n.op_type for n in fused.graph.node]
    x = rng.standard_normal((1, 3, 2, D)).astype(np.float32)
    np.testing.assert_array_equal(_run(fused, x), _run(model, x))
