"""Rotary's ``rotate_half`` as one MatMul by a signed permutation, for the ORT-optimized graph.

Exporters write ``rotate_half(x) = Concat(-x[..., D/2:], x[..., :D/2])`` as four
nodes (Slice, Slice, Neg, Concat) on q and on k of every layer (SmolLM2: 240
nodes a step). ``x @ R`` with ``R[k + D/2, k] = -1`` and ``R[k, k + D/2] = 1`` is
one node and bit-identical: each output is one ``+-x`` plus exact zeros.

:func:`fuse_rotate_half` matches the four nodes structurally: one ``x`` with a
static even last dim ``D`` (from shape inference), both Slices on the last axis
with step 1, bounds ``[D/2, end)`` under the Neg and ``[0, D/2)`` after it, the
Concat on the last axis. Bounds are read from constants, or folded from small
constant int64 chains (``shared_shapes`` turns the source's ``Shape -> Gather ->
Div`` into those). Used by ``ort_graph.prepared_graph`` only; the exporter
validates its result against the source.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

FOLDABLE = {"Identity", "Unsqueeze", "Squeeze", "Div", "Mul", "Add", "Sub", "Concat", "Cast", "Gather",
            "Reshape", "Constant"}
MAX_FOLD = 16  # elements: only index arithmetic is folded


def _small_constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Values of the small integer tensors computable from constants alone."""
    from onnx.reference import ReferenceEvaluator

    known = {t.name: numpy_helper.to_array(t) for t in graph.initializer
             if t.data_type == onnx.TensorProto.INT64 and np.prod(t.dims, dtype=np.int64) <= MAX_FOLD}
    for node in graph.node:
        if node.op_type not in FOLDABLE or node.domain not in ("", "ai.onnx"):
            continue
        if not all(i in known for i in node.input if i):
            continue
        if node.op_type == "Constant" and node.attribute[0].name != "value":
            continue
        try:
            outs = ReferenceEvaluator(node).run(None, {i: known[i] for i in node.input if i})
        except Exception:  # an op the evaluator cannot run here: leave it to ORT
            continue
        for name, value in zip(node.output, outs):
            value = np.asarray(value)
            if value.dtype.kind in "iu" and value.size <= MAX_FOLD:
                known[name] = value
    return known


def rotation(head_dim: int, dtype=np.float32) -> np.ndarray:
    """``R`` with ``x @ R == concat(-x[..., h:], x[..., :h])`` for ``h = head_dim // 2``."""
    h = head_dim // 2
    r = np.zeros((head_dim, head_dim), dtype)
    r[np.arange(h) + h, np.arange(h)] = -1
    r[np.arange(h), np.arange(h) + h] = 1
    return r


def fuse_rotate_half(model: onnx.ModelProto, shapes: dict[str, tuple[int, list]]) -> int:
    """Rewrite every matched ``rotate_half`` of ``model``'s main graph in place: the Concat
    becomes a MatMul by :func:`rotation` (the Slices and the Neg are left for dead-node
    removal). ``shapes``: value name -> (ONNX elem type, inferred dims). Returns the count."""
    graph = model.graph
    const = _small_constants(graph)
    producer = {o: n for n in graph.node for o in n.output}
    r_names: dict[int, str] = {}
    count = 0

    def scalar(name: str):
        v = const.get(name)
        return int(v.reshape(-1)[0]) if v is not None and v.size == 1 else None

    def last_axis(axis, rank: int) -> bool:
        return axis is not None and (axis == -1 or axis == rank - 1)

    def slice_bounds(node):  # (x, start, end) of a float32 last-axis step-1 Slice with static D, else None
        if node is None or node.op_type != "Slice" or len(node.input) < 4:
            return None
        elem, dims = shapes.get(node.input[0], (None, None))
        if elem != onnx.TensorProto.FLOAT or not dims or not isinstance(dims[-1], int):
            return None
        step = scalar(node.input[4]) if len(node.input) > 4 and node.input[4] else 1
        start, end = scalar(node.input[1]), scalar(node.input[2])
        if not last_axis(scalar(node.input[3]), len(dims)) or step != 1 or start is None or end is None:
            return None
        return node.input[0], start, min(end, dims[-1])

    for node in graph.node:
        if node.op_type != "Concat" or len(node.input) != 2 or node.domain not in ("", "ai.onnx"):
            continue
        neg = producer.get(node.input[0])
        if neg is None or neg.op_type != "Neg":
            continue
        hi, lo = slice_bounds(producer.get(neg.input[0])), slice_bounds(producer.get(node.input[1]))
        if hi is None or lo is None or hi[0] != lo[0]:
            continue
        dims = shapes[hi[0]][1]
        d = dims[-1]
        if d % 2 or not last_axis(helper.get_attribute_value(node.attribute[0]), len(dims)):
            continue
        if (hi[1], hi[2], lo[1], lo[2]) != (d // 2, d, 0, d // 2):
            continue
        if d not in r_names:
            r_names[d] = f"tinyserve_rotate_half_{d}"
            graph.initializer.append(numpy_helper.from_array(rotation(d), r_names[d]))
        out = list(node.output)
        node.Clear()
        node.CopyFrom(helper.make_node("MatMul", [hi[0], r_names[d]], out, name=f"tinyserve_rotate_half/{out[0]}"))
        count += 1
    return count
