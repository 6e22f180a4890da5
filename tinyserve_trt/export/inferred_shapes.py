"""onnx's shape inference typing an onnx-ir model's main-graph values, weights left unread.

The ORT graph's passes read the shapes on the values (``shared_shapes.py``, the fusions):
:class:`InferShapes` runs ``onnx.shape_inference.infer_shapes`` (data propagation on, as
the proto passes did) on one serialized copy of the model and sets each main-graph value's
type and shape from the result, by name. A large inline initializer is serialized as a
placeholder external reference for that call (inference reads dims and types, never
bytes), so no weight is copied; an external one already is a reference.

Not onnx-ir's ``ShapeInferencePass``: that one deserializes the whole inferred model again
to merge it (every subgraph too) - 28% of ``prepared_graph``'s time on the tiny LLaMA
fixture (cProfile) - where the passes read only the main graph's values.
"""

from __future__ import annotations

import onnx_ir as ir

DETACH_BYTES = 1 << 16  # an inline tensor this large goes to inference as a reference, not bytes


class InferShapes(ir.passes.InPlacePass):
    """Type the main graph's values by onnx shape inference (see the module doc). Leaves the
    model unchanged when inference fails (the passes after then match less)."""

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
        try:
            typed = shape_inference.infer_shapes(proto, data_prop=True)
        except Exception:  # inference refused the graph: the passes see the shapes it had
            return ir.passes.PassResult(model, modified=False)
        values = {v.name: v for n in graph for v in n.outputs if v.name}
        values.update((v.name, v) for v in graph.inputs)
        modified = False
        for vi in [*typed.graph.value_info, *typed.graph.output]:
            v = values.get(vi.name)
            if v is None or not vi.type.HasField("tensor_type"):
                continue
            shape = ir.serde.deserialize_type_proto_for_shape(vi.type)
            kind = ir.serde.deserialize_type_proto_for_type(vi.type)
            if shape is not None and shape != v.shape:
                v.shape, modified = shape, True
            if kind is not None and kind.dtype != ir.DataType.UNDEFINED and kind != v.type:
                v.type, modified = kind, True
        return ir.passes.PassResult(model, modified=modified)
