"""onnx's shape inference typing an onnx-ir model's main-graph values, weights left unread.

The ORT graph's passes read the values' shapes (``shared_shapes.py``, the fusions):
:class:`InferShapes` runs ``onnx.shape_inference.infer_shapes`` (data propagation on, as
the proto passes did) on one serialized copy of the model and records each main-graph
value's inferred type and dims, by name, in ``value.meta`` (``ir_graph.dims`` / ``dtype``
read them). It does not change the graph: written as value_info, the inferred shapes
made SmolLM2's ``model.ort.onnx`` 35% larger (524 more entries, kept by ORT) for the
same nodes. A large inline initializer is serialized as a
placeholder external reference for that call (inference reads dims and types, never
bytes), so no weight is copied; an external one already is a reference.

Not onnx-ir's ``ShapeInferencePass``: that one deserializes the whole inferred model again
to merge it (every subgraph too) - 28% of ``prepared_graph``'s time on the tiny LLaMA
fixture (cProfile) - where the passes read only the main graph's values.
"""

from __future__ import annotations

import onnx_ir as ir

from .ir_graph import INFERRED

DETACH_BYTES = 1 << 16  # an inline tensor this large goes to inference as a reference, not bytes


class InferShapes(ir.passes.InPlacePass):
    """Record the main graph's values' inferred types and dims (see the module doc); an earlier
    record is replaced. When inference fails, the passes after see the values' own shapes."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnx import shape_inference

        graph = model.graph
        held = {}
        for v in graph.initializers.values():
            t = v.const_value
            if t is not None and not isinstance(t, ir.ExternalTensor) and t.nbytes > DETACH_BYTES:
                held[v] = t
                v.const_value = ir.ExternalTensor("tinyserve-detached", 0, t.nbytes, t.dtype, shape=t.shape,
                                                  name=v.name)
        try:
            proto = ir.serde.serialize_model(model)
        finally:
            for v, t in held.items():
                v.const_value = t
        _stand_in_native(proto)
        try:
            typed = shape_inference.infer_shapes(proto, data_prop=True)
        except Exception:  # inference refused the graph: the passes see the shapes it had
            return ir.passes.PassResult(model, modified=False)
        values = {v.name: v for n in graph for v in n.outputs if v.name}
        values.update((v.name, v) for v in graph.inputs)
        for v in values.values():
            v.meta.pop(INFERRED, None)
        for vi in [*typed.graph.input, *typed.graph.value_info, *typed.graph.output]:
            v = values.get(vi.name)
            if v is None or not vi.type.HasField("tensor_type"):
                continue
            shape = ir.serde.deserialize_type_proto_for_shape(vi.type)
            kind = ir.serde.deserialize_type_proto_for_type(vi.type)
            elem = kind.dtype if kind is not None and kind.dtype != ir.DataType.UNDEFINED else None
            v.meta[INFERRED] = (elem, None if shape is None else [d if isinstance(d, int) else d.value for d in shape])
        return ir.passes.PassResult(model, modified=False)


def _stand_in_native(proto) -> None:
    """Give onnx's inference a way through the native CPU node (a custom op it has no schema for, so
    every value after it would be untyped): in this copy each becomes ``Identity(query)``, whose
    output has the node's output shape ``[B, H, S, D]`` and type; its ``selected_pages``, a graph
    output, keeps its declared type."""
    from onnx import helper

    from .native_decode import NATIVE_DOMAIN, NATIVE_OP

    for i, node in enumerate(proto.graph.node):
        if (node.domain, node.op_type) == (NATIVE_DOMAIN, NATIVE_OP) and node.output and node.output[0]:
            proto.graph.node[i].CopyFrom(helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name))
