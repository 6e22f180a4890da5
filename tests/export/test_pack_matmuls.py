"""Packed projections: MatMuls that share an activation become one MatMul + Split, the
concatenated weight replacing the originals; outputs match the unpacked graph."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tinyserve_trt.export.pack_matmuls import pack_shared_matmuls

ort = pytest.importorskip("onnxruntime")
K = 8


def _model(opset: int = 17) -> onnx.ModelProto:
    """x -> q, k, v projections (packable), h -> gate, up (packable), h -> o twice over one
    weight (not packable: the weight has another reader), and a lone projection."""
    rng = np.random.default_rng(0)

    def w(name, n, rows=K):
        return numpy_helper.from_array(rng.standard_normal((rows, n)).astype(np.float32), name)

    inits = [w("wq", 8), w("wk", 4), w("wv", 4), w("wg", 6), w("wu", 6), w("wo", K), w("wl", 3, rows=16)]
    nodes = [
        helper.make_node("Relu", ["inp"], ["x"]),
        helper.make_node("MatMul", ["x", "wq"], ["q"]),
        helper.make_node("Relu", ["q"], ["q_act"]),  # a reader between the group's MatMuls
        helper.make_node("MatMul", ["x", "wk"], ["k"]),
        helper.make_node("MatMul", ["x", "wv"], ["v"]),
        helper.make_node("Concat", ["q_act", "k", "v"], ["qkv"], axis=-1),
        helper.make_node("Sigmoid", ["x"], ["h"]),
        helper.make_node("MatMul", ["h", "wg"], ["g"]),
        helper.make_node("MatMul", ["h", "wu"], ["u"]),
        helper.make_node("Mul", ["g", "u"], ["gu"]),
        helper.make_node("MatMul", ["h", "wo"], ["o"]),
        helper.make_node("MatMul", ["h", "wo"], ["o_again"]),
        helper.make_node("Add", ["o", "o_again"], ["o2"]),
        helper.make_node("MatMul", ["qkv", "wl"], ["lone"]),
    ]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3, w])
            for n, w in (("qkv", 16), ("gu", 6), ("o2", K), ("lone", 3))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("inp", TensorProto.FLOAT, [2, 3, K])],
                              outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"inp": x})


@pytest.mark.parametrize("opset", [11, 17])
def test_shared_input_projections_pack_into_one_matmul(opset):
    model = _model(opset)
    packed = _model(opset)
    assert pack_shared_matmuls(packed) == 3  # k, v into q's; u into g's
    onnx.checker.check_model(packed, full_check=True)
    ops = [n.op_type for n in packed.graph.node]
    assert ops.count("MatMul") == 5 and ops.count("Split") == 2, ops  # qkv, gate/up, o twice, lone
    names = {t.name for t in packed.graph.initializer}
    assert not {"wq", "wk", "wv", "wg", "wu"} & names and {"wo", "wl"} <= names  # replaced, not copied
    weights = sum(numpy_helper.to_array(t).size for t in packed.graph.initializer if t.data_type == TensorProto.FLOAT)
    assert weights == sum(numpy_helper.to_array(t).size for t in model.graph.initializer)
    x = np.random.default_rng(1).standard_normal((2, 3, K)).astype(np.float32)
    for want, got in zip(_run(model, x), _run(packed, x)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_packed_model_has_nothing_left_to_pack():
    model = _model()
    pack_shared_matmuls(model)
    once = model.SerializeToString()
    assert pack_shared_matmuls(model) == 0 and model.SerializeToString() == once
