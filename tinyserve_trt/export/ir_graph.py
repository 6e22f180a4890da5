"""Small onnx-ir helpers the ORT graph's post-passes share (``ort_passes.py``).

:func:`dims` and :func:`dtype` read what ``inferred_shapes.InferShapes`` inferred for a value
(kept in ``value.meta``, never written into the graph: the serialized model keeps the
source's value_info), else the value's own shape and type. They read values and constants
of an ``onnx_ir`` graph without loading weight bytes:
:func:`small_array` returns a constant's value only when it is inline and at most
``max_size`` elements, so an ``ir.ExternalTensor`` (a weight in ``model.onnx.data``)
is never read.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

STANDARD = ("", "ai.onnx")
INFERRED = "tinyserve_inferred"  # value.meta key: (ir.DataType or None, dims or None) by shape inference


def dims(value: ir.Value | None) -> list | None:
    """The value's dims as ints, dim names (str) or None (unknown); None without a shape."""
    if value is None:
        return None
    if INFERRED in value.meta:
        return value.meta[INFERRED][1]
    return None if value.shape is None else [d if isinstance(d, int) else d.value for d in value.shape]


def dtype(value: ir.Value | None) -> ir.DataType | None:
    """The value's element type (inferred, else its own), None when unknown."""
    if value is None:
        return None
    if INFERRED in value.meta and value.meta[INFERRED][0] is not None:
        return value.meta[INFERRED][0]
    return value.dtype


def node_of(value: ir.Value | None, op: str) -> ir.Node | None:
    """The standard-domain ``op`` node that makes ``value``, else None."""
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op and node.domain in STANDARD else None


def constant_tensor(value: ir.Value | None):
    """The tensor of an initializer or of a ``Constant(value=...)`` output, else None (not read)."""
    if value is None:
        return None
    if value.const_value is not None and value.is_initializer():
        return value.const_value
    node = value.producer()
    if node is not None and node.op_type == "Constant" and node.domain in STANDARD and "value" in node.attributes:
        return node.attributes["value"].as_tensor()
    return None


def small_array(value: ir.Value | None, max_size: int | None = None) -> np.ndarray | None:
    """A constant's value (:func:`constant_tensor`) when it is inline data of at most ``max_size``
    elements (None: any inline size); an external tensor is never read."""
    t = constant_tensor(value)
    if t is None or isinstance(t, ir.ExternalTensor) or (max_size is not None and t.size > max_size):
        return None
    return t.numpy()


def attr(node: ir.Node, name: str, default=None):
    """An attribute's Python value (ints as a list), or ``default``."""
    a = node.attributes.get(name)
    if a is None:
        return default
    return list(a.value) if a.type in (ir.AttributeType.INTS, ir.AttributeType.FLOATS) else a.value


def initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """A new initializer ``name`` of ``graph`` holding ``array`` (or the one of that name already made)."""
    if name in graph.initializers:
        return graph.initializers[name]
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                     const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value


def replace(graph: ir.Graph, node: ir.Node, new_nodes: list[ir.Node], outputs: list[ir.Value]) -> None:
    """``new_nodes`` where ``node`` was; ``outputs`` take its outputs' names, types and readers."""
    ir.convenience.replace_nodes_and_values(graph, node, [node], new_nodes, list(node.outputs), outputs)


def use_opset(model: ir.Model, domain: str, version: int) -> None:
    """``model`` imports ``domain`` (at ``version`` when it did not)."""
    model.graph.opset_imports.setdefault(domain, version)


class CountingRewrite(ir.passes.InPlacePass):
    """An in-place pass whose work is :meth:`rewrite` (model -> rewrites made); ``count``: the last call's."""

    count = 0

    def rewrite(self, model: ir.Model) -> int:
        raise NotImplementedError

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.count = self.rewrite(model)
        return ir.passes.PassResult(model, modified=bool(self.count))
