"""Rotary -> com.microsoft::RotaryEmbedding in the ORT graph; its caches are the step's own
cos/sin rows, indexed by token (``export/rotary.py``).

The graphs are the legacy LLaMA export's rotary: cos/sin of position x inverse frequency,
halves concatenated, unsqueezed over heads; ``x * cos + rotate_half(x) * sin`` on q and k,
rotate_half as Slice/Neg/Concat (``prepared_graph`` makes it a MatMul first).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tinyserve_trt.export.ort_graph import prepared_graph

ort = pytest.importorskip("onnxruntime")
H, D, P = 3, 8, 64


def _i64(name, *values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _rope(nodes, x, out, cos, sin):
    h = D // 2
    nodes += [helper.make_node("Slice", [x, f"{out}_h", "big", "last"], [f"{out}_x2"]),
              helper.make_node("Neg", [f"{out}_x2"], [f"{out}_n"]),
              helper.make_node("Slice", [x, "zero_i", f"{out}_h", "last"], [f"{out}_x1"]),
              helper.make_node("Concat", [f"{out}_n", f"{out}_x1"], [f"{out}_rot"], axis=-1),
              helper.make_node("Mul", [x, cos], [f"{out}_c"]),
              helper.make_node("Mul", [f"{out}_rot", sin], [f"{out}_s"]),
              helper.make_node("Add", [f"{out}_c", f"{out}_s"], [out])]
    return [_i64(f"{out}_h", h)]


def _model(*, second_freqs_scale: float = 1.0, mix_input: bool = False, scaling: float | None = None
           ) -> onnx.ModelProto:
    """q, k [B, H, S, D] rotated by position_ids [B, S]. ``second_freqs_scale`` != 1 makes the
    halves differ (not rotate_half's layout); ``mix_input`` makes cos read a second input;
    ``scaling``: cos and sin times that constant, then a Cast (transformers' attention_scaling)."""
    inv = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    nodes = [helper.make_node("Add", ["q_in", "zero"], ["q"]), helper.make_node("Add", ["k_in", "zero"], ["k"]),
             helper.make_node("Unsqueeze", ["position_ids", "axis2"], ["pos3"]),
             helper.make_node("Cast", ["pos3"], ["posf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["posf", "inv_freq"], ["freqs"]),
             helper.make_node("Mul", ["freqs", "scale2"], ["freqs2"]),
             helper.make_node("Concat", ["freqs", "freqs2" if second_freqs_scale != 1.0 else "freqs"], ["emb"],
                              axis=-1),
             helper.make_node("Cos", ["emb"], ["cos0" if mix_input or scaling else "cos"]),
             helper.make_node("Sin", ["emb"], ["sin0" if scaling else "sin"]),
             *([helper.make_node("Mul", [f"{t}0", "att"], [f"{t}1"]) for t in ("cos", "sin")] +
               [helper.make_node("Cast", [f"{t}1"], [t], to=TensorProto.FLOAT) for t in ("cos", "sin")]
               if scaling else []),
             *([helper.make_node("Add", ["cos0", "extra"], ["cos"])] if mix_input else []),
             helper.make_node("Unsqueeze", ["cos", "axis1"], ["cos_u"]),
             helper.make_node("Unsqueeze", ["sin", "axis1"], ["sin_u"])]
    inits = [numpy_helper.from_array(np.zeros((), np.float32), "zero"), _i64("axis2", 2), _i64("axis1", 1),
             numpy_helper.from_array(inv, "inv_freq"),
             numpy_helper.from_array(np.float32(second_freqs_scale), "scale2"),
             _i64("big", 2**62), _i64("zero_i", 0), _i64("last", -1),
             numpy_helper.from_array(np.float32(scaling or 1.0), "att")]
    inits += _rope(nodes, "q", "q_out", "cos_u", "sin_u") + _rope(nodes, "k", "k_out", "cos_u", "sin_u")
    inputs = [helper.make_tensor_value_info("q_in", TensorProto.FLOAT, ["B", H, "S", D]),
              helper.make_tensor_value_info("k_in", TensorProto.FLOAT, ["B", H, "S", D]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["B", "S"])]
    if mix_input:
        inputs.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, [1]))
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", H, "S", D]) for n in ("q_out", "k_out")]
    graph = helper.make_graph(nodes, "rope", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _run(model, feeds):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _feeds(rng, model, high=P):
    feeds = {"q_in": rng.standard_normal((2, H, 5, D)).astype(np.float32),
             "k_in": rng.standard_normal((2, H, 5, D)).astype(np.float32),
             "position_ids": rng.integers(0, high, (2, 5)).astype(np.int64)}
    if any(i.name == "extra" for i in model.graph.input):
        feeds["extra"] = np.ones(1, np.float32)
    return feeds


def _ops(model):
    return [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("scaling", [None, 0.75])
def test_rotary_becomes_rotary_embedding(rng, scaling):
    model = _model(scaling=scaling)
    fused = prepared_graph(model)
    ops = _ops(fused)
    assert ops.count("RotaryEmbedding") == 2 and not {"Neg", "MatMul", "Concat"} & set(ops), ops
    assert ops.count("Cos") == ops.count("Sin") == 1  # the step's tables, shared by q and k
    assert ops.count("Unsqueeze") == 1  # position_ids' (the frequencies); cos/sin's are gone
    assert not any(t.name.startswith("tinyserve_rotary") and np.prod(t.dims) > 2 for t in fused.graph.initializer)
    for high in (P, 10**6):  # any position: no precomputed table to run past
        feeds = _feeds(rng, model, high=high)
        for got, want in zip(_run(fused, feeds), _run(model, feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs", [dict(second_freqs_scale=2.0), dict(mix_input=True)],
                         ids=["unequal_halves", "cos_reads_another_input"])
def test_other_rotaries_are_left_alone(rng, kwargs):
    model = _model(**kwargs)
    fused = prepared_graph(model)
    assert "RotaryEmbedding" not in _ops(fused)
    feeds = _feeds(rng, model)
    for got, want in zip(_run(fused, feeds), _run(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
