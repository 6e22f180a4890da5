"""Rotary's ``rotate_half`` as one MatMul by a signed permutation, for the ORT-optimized graph.

Exporters write ``rotate_half(x) = Concat(-x[..., D/2:], x[..., :D/2])`` as four
nodes (Slice, Slice, Neg, Concat) on q and on k of every layer (SmolLM2: 240
nodes a step). ``x @ R`` with ``R[k + D/2, k] = -1`` and ``R[k, k + D/2] = 1`` is
one node and bit-identical: each output is one ``+-x`` plus exact zeros.

:class:`FuseRotateHalf` (an onnx-ir pass of ``ort_passes.py``) matches the four nodes structurally: one ``x`` with a
static even last dim ``D`` (from shape inference), both Slices on the last axis
with step 1, bounds ``[D/2, end)`` under the Neg and ``[0, D/2)`` after it, the
Concat on the last axis. Bounds are read from constants, or folded from small
constant int64 chains (``shared_shapes`` turns the source's ``Shape -> Gather ->
Div`` into those). onnxscript's rewriter has no such rewrite (its rotary fusion
matches the Slice/Neg/Concat form itself). Used by ``ort_graph.prepared_graph`` only;
the exporter validates its result against the source.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .ir_graph import STANDARD, attr, dims, dtype, initializer, replace, small_array

FOLDABLE = {"Identity", "Unsqueeze", "Squeeze", "Div", "Mul", "Add", "Sub", "Concat", "Cast", "Gather",
            "Reshape", "Constant"}
MAX_FOLD = 16  # elements: only index arithmetic is folded


def _small_constants(graph: ir.Graph) -> dict[ir.Value, np.ndarray]:
    """Values of the small integer tensors computable from constants alone."""
    from onnx.reference import ReferenceEvaluator

    known = {v: v.const_value.numpy() for v in graph.initializers.values()
             if v.dtype == ir.DataType.INT64 and v.const_value is not None
             and not isinstance(v.const_value, ir.ExternalTensor) and v.const_value.size <= MAX_FOLD}
    for node in graph:
        if node.op_type not in FOLDABLE or node.domain not in STANDARD:
            continue
        if not all(i in known for i in node.inputs if i is not None):
            continue
        if node.op_type == "Constant" and "value" not in node.attributes:
            continue
        try:
            outs = ReferenceEvaluator(ir.serde.serialize_node(node)).run(
                None, {i.name: known[i] for i in node.inputs if i is not None})
        except Exception:  # an op the evaluator cannot run here: leave it to ORT
            continue
        for out, value in zip(node.outputs, outs):
            value = np.asarray(value)
            if value.dtype.kind in "iu" and value.size <= MAX_FOLD:
                known[out] = value
    return known


def rotation(head_dim: int, dtype=np.float32) -> np.ndarray:
    """``R`` with ``x @ R == concat(-x[..., h:], x[..., :h])`` for ``h = head_dim // 2``."""
    h = head_dim // 2
    r = np.zeros((head_dim, head_dim), dtype)
    r[np.arange(h) + h, np.arange(h)] = -1
    r[np.arange(h), np.arange(h) + h] = 1
    return r


class FuseRotateHalf(ir.passes.InPlacePass):
    """Rewrite every matched ``rotate_half`` of the main graph in place: the Concat becomes a
    MatMul by :func:`rotation` (the Slices and the Neg are left for RemoveUnusedNodesPass).
    Reads the values' inferred shapes (InferShapes before). ``count``: the last call's."""

    count = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        const = _small_constants(graph)
        count = 0

        def scalar(value):
            v = const.get(value) if value is not None else None
            return int(v.reshape(-1)[0]) if v is not None and v.size == 1 else None

        def last_axis(axis, rank: int) -> bool:
            return axis is not None and (axis == -1 or axis == rank - 1)

        def slice_bounds(node):  # (x, start, end) of a float32 last-axis step-1 Slice with static D, else None
            if node is None or node.op_type != "Slice" or len(node.inputs) < 4:
                return None
            x = node.inputs[0]
            d = dims(x)
            if dtype(x) != ir.DataType.FLOAT or not d or not isinstance(d[-1], int):
                return None
            step = scalar(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else 1
            start, end = scalar(node.inputs[1]), scalar(node.inputs[2])
            if not last_axis(scalar(node.inputs[3]), len(d)) or step != 1 or start is None or end is None:
                return None
            return x, start, min(end, d[-1])

        for node in list(graph):
            if node.op_type != "Concat" or len(node.inputs) != 2 or node.domain not in STANDARD:
                continue
            neg = node.inputs[0].producer() if node.inputs[0] is not None else None
            if neg is None or neg.op_type != "Neg":
                continue
            hi = slice_bounds(neg.inputs[0].producer())
            lo = slice_bounds(node.inputs[1].producer() if node.inputs[1] is not None else None)
            if hi is None or lo is None or hi[0] is not lo[0]:
                continue
            d = dims(hi[0])
            if d[-1] % 2 or not last_axis(attr(node, "axis"), len(d)):
                continue
            h = d[-1]
            if (hi[1], hi[2], lo[1], lo[2]) != (h // 2, h, 0, h // 2):
                continue
            r = initializer(graph, f"tinyserve_rotate_half_{h}", rotation(h))
            out = node.outputs[0]
            mm = ir.node("MatMul", [hi[0], r], name=f"tinyserve_rotate_half/{out.name}")
            replace(graph, node, [mm], [mm.outputs[0]])
            count += 1
        self.count = count
        return ir.passes.PassResult(model, modified=bool(count))
