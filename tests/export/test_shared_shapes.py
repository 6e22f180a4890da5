"""shared_shapes: the op's per-step bookkeeping is computed once per step, not once per layer.

A model of ``L`` op nodes that share ``page_table`` / ``past_lens`` / ``token_budget``
(as an export's layers do; the queries are activations, not graph inputs) is
prepared by ``ort_graph.prepared_graph`` and optimized by ORT: each extra layer
then adds far fewer nodes than without the pass, and the outputs are the same
as the portable model's, decode and prefill, single- and two-level.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tinyserve_dev.cases import CaseSpec, make_case
from tinyserve_trt.export.ort_graph import prepared_graph
from tinyserve_trt.export.shared_shapes import ShareShapeDims
from tinyserve_trt.ops import schema
from tinyserve_trt.ops.node import attach_functions, make_node

ort = pytest.importorskip("onnxruntime")
SHARED = ("page_table", "past_lens", "token_budget")
H, HKV, D, PS = 6, 2, 16, 8


def _layers_model(layers: int, attrs: schema.OpAttributes) -> onnx.ModelProto:
    """``layers`` op nodes; layer i reads ``query`` + i (an activation) and its own pools."""
    slots = schema.node_input_names(two_level=attrs.two_level)  # "" = a skipped optional input
    names = [n for n in slots if n]
    by_name = {s.name: s for s in schema.INPUTS}
    types = {"T": TensorProto.FLOAT, "int32": TensorProto.INT32, "uint8": TensorProto.UINT8}
    fixed = {"Hkv": HKV, "D": D, "ps": PS, "H": H, "r": PS // max(attrs.sub_page_size, 1)}

    def vi(name, spec):
        return helper.make_tensor_value_info(name, types[spec.dtype], [fixed.get(d, d) for d in spec.shape])

    inputs = [vi(n, by_name[n]) for n in SHARED + ("query",)]
    nodes, outs = [], []
    for i in range(layers):
        own = {n: f"{n}.{i}" for n in names if n not in SHARED}
        inputs += [vi(own[n], by_name[n]) for n in names if n not in SHARED and n != "query"]
        q = f"q.{i}"
        nodes.append(helper.make_node("Constant", [], [f"shift.{i}"], value=helper.make_tensor(
            f"shift.{i}", TensorProto.FLOAT, [], [0.1 * i])))
        nodes.append(helper.make_node("Add", ["query", f"shift.{i}"], [q]))
        ins = ["" if not n else q if n == "query" else n if n in SHARED else own[n] for n in slots]
        nodes.append(make_node(ins, [f"out.{i}", f"sel.{i}"], attrs, name=f"qsa.{i}"))
        outs.append(helper.make_tensor_value_info(f"out.{i}", TensorProto.FLOAT, ["B", H, "S", D]))
    graph = helper.make_graph(nodes, "layers", inputs, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", schema.OPSET)], ir_version=10)
    return attach_functions(model)


def _feeds(model: onnx.ModelProto, case: dict) -> dict:
    return {vi.name: case[vi.name.split(".")[0]] for vi in model.graph.input}


def _optimized_nodes(model: onnx.ModelProto, tmp_path, name: str) -> int:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp_path / name)
    so.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return len(onnx.load(str(tmp_path / name)).graph.node)


ATTRS = [schema.OpAttributes(), schema.OpAttributes(sub_page_size=2)]


@pytest.mark.parametrize("attrs", ATTRS, ids=["single_level", "two_level"])
def test_each_layer_adds_fewer_nodes(attrs, tmp_path):
    def per_layer(prepare) -> int:
        counts = [_optimized_nodes(prepare(_layers_model(n, attrs)), tmp_path, f"{n}.onnx") for n in (2, 3)]
        return counts[1] - counts[0]

    plain, shared = per_layer(lambda m: m), per_layer(prepared_graph)
    # the per-step bookkeeping (~40 nodes) leaves the per-layer part
    assert shared <= plain - 35, (plain, shared)


def test_shape_nodes_become_constants_or_shared_dims():
    import onnx_ir as ir
    from onnx_ir.passes.common import InlinePass, RemoveUnusedNodesPass

    from tinyserve_trt.export.inferred_shapes import InferShapes

    model = _layers_model(2, schema.OpAttributes())
    work, share = ir.serde.deserialize_model(model), ShareShapeDims()
    ir.passes.PassManager([InlinePass(), InferShapes(), share,
                           RemoveUnusedNodesPass()])(work)
    prepared = ir.serde.serialize_model(work)
    assert share.rewritten > 0 and not prepared.functions
    shapes = [n for n in prepared.graph.node if n.op_type == "Shape"]
    # what is left reads a graph input's own dims or a per-layer activation, never a pool's static dims
    for n in shapes:
        dims = {helper.get_attribute_value(a) for a in n.attribute}
        assert not (n.input[0].startswith("key_cache") and dims & {1, 2, 3}), n
    assert len(model.functions) == 1  # the input model is left as it was


@pytest.mark.parametrize("attrs", ATTRS, ids=["single_level", "two_level"])
@pytest.mark.parametrize("new_tokens,budget", [(1, 16), (1, 0), (3, 16)])
def test_prepared_graph_computes_what_the_portable_model_does(attrs, new_tokens, budget, rng):
    model = _layers_model(3, attrs)
    case = make_case(CaseSpec((5, 30, 61), H, HKV, D, PS, new_tokens, "float32", budget,
                              sub_page_size=attrs.sub_page_size), rng)
    feeds = _feeds(model, case)
    outs = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
            for m in (model, prepared_graph(model))]
    for a, b in zip(*outs):
        np.testing.assert_allclose(b, a, **schema.TOLERANCES["float32"])


def _reshaping_layers(layers: int) -> onnx.ModelProto:
    """An opset-17 residual stream ``h [batch, seq, 8]`` through ``layers`` blocks that, as an
    exporter's attention does, reshape by dims read with ``Shape`` (``[b, s, -1, 4]`` and back)."""
    c = lambda name, vals, shape: helper.make_node("Constant", [], [name], value=helper.make_tensor(  # noqa: E731
        name, TensorProto.INT64, shape, vals))
    nodes = [c("i0", [0], []), c("i1", [1], []), c("ax", [0], [1]), c("m1", [-1], [1]), c("four", [4], [1])]
    h = "x"
    for i in range(layers):
        p = f"l{i}."
        nodes += [helper.make_node("Shape", [h], [p + "s"]),
                  helper.make_node("Gather", [p + "s", "i0"], [p + "b"], axis=0),
                  helper.make_node("Gather", [p + "s", "i1"], [p + "t"], axis=0),
                  helper.make_node("Unsqueeze", [p + "b", "ax"], [p + "ub"]),
                  helper.make_node("Unsqueeze", [p + "t", "ax"], [p + "ut"]),
                  helper.make_node("Concat", [p + "ub", p + "ut", "m1", "four"], [p + "split"], axis=0),
                  helper.make_node("Concat", [p + "ub", p + "ut", "m1"], [p + "join"], axis=0),
                  helper.make_node("Reshape", [h, p + "split"], [p + "heads"]),
                  helper.make_node("Reshape", [p + "heads", p + "join"], [p + "back"]),
                  helper.make_node("Add", [h, p + "back"], [p + "h"])]
        h = p + "h"
    graph = helper.make_graph(nodes, "reshaping", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                              ["batch", "seq", 8])], [helper.make_tensor_value_info(h, TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_every_layer_shares_its_dims_after_the_opset_raise():
    # onnx.version_converter writes value_info typed without data propagation (a Reshape by a
    # computed shape: every dim unknown); kept, they hid from ShareShapeDims every layer after the
    # first - SmolLM2's model.ort.onnx kept 7 shape nodes per layer (Shape, 2 Gather, 2 Unsqueeze,
    # 2 Concat) that the graph at the source opset does not.
    model = _reshaping_layers(3)
    for opset in (None, 21):
        prepared = prepared_graph(model, contrib_ops=False, opset=opset)
        of_x = {n.output[0] for n in prepared.graph.node if n.op_type == "Shape" and n.input[0] == "x"}
        own = [(n.op_type, n.input[0]) for n in prepared.graph.node  # (x's own dims stay read off x)
               if n.op_type in ("Shape", "Gather") and n.input[0] not in {"x", *of_x}]
        assert not own, (opset, own)
    assert not model.graph.value_info  # the input model is left as it was
