"""Resolve ``Shape`` nodes to constants or to a graph input's dim, so ORT merges per-layer bookkeeping.

After the op's function is inlined, every layer computes the same per-step page
metadata (page counts, valid / forced pages, keep counts, the dense switch, the
rank masks) from dims it reads with ``Shape`` nodes. ORT's common-subexpression
elimination merges nodes only when their inputs are the same values, and ORT
folds a ``Shape`` only when its input's whole shape is static - so each layer's
``Shape(key_cache.i)`` / ``Shape(query_i)`` keeps a private copy of everything
downstream (~125 nodes per layer for SmolLM2).

:class:`ShareShapeDims` uses the model's inferred shapes: a ``Shape`` node whose
dims are all static becomes a constant; a dim named by a symbolic parameter that
a graph input also has (``sequence_length`` of ``input_ids``, ``batch`` of
``page_table``) is read off that input instead (one ``Shape`` per input dim, shared).
ORT's constant folding and CSE then compute the metadata once per step.

An onnx-ir pass (:class:`ShareShapeDims`) of the ORT graph's pipeline (``ort_passes.py``),
after ``onnx_ir``'s InlinePass and ``inferred_shapes.InferShapes`` (data propagation on): the portable model
keeps its Shapes. Sound where shape inference is (equal dim names are equal sizes); the
exporter validates the resulting graph against the source like the portable one.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .ir_graph import STANDARD, attr, dims, replace, small_array

PREFIX = "tinyserve_shared_shape"


class ShareShapeDims(ir.passes.InPlacePass):
    """Rewrite the main graph's resolvable ``Shape`` nodes (and a ``Gather`` of one dim of a
    whole-shape ``Shape``) by its values' inferred dims (see the module doc); reads no weights.
    ``rewritten``: how many the last call rewrote. The Shapes left dead are for RemoveUnusedNodesPass."""

    rewritten = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        sources: dict[str, tuple[ir.Value, int]] = {}  # dim_param -> (graph input, axis)
        for value in graph.inputs:
            for axis, d in enumerate(dims(value) or []):
                if isinstance(d, str):
                    sources.setdefault(d, (value, axis))
        inputs = set(graph.inputs)
        shared: dict[tuple, ir.Value] = {}  # (kind, dim or input name, axis) -> the value made once
        head: list[ir.Node] = []  # made during the walk, put first after it (they read graph inputs only)

        def dim_source(d) -> ir.Value | None:
            if isinstance(d, int) and not isinstance(d, bool) and d > 0:
                key = ("const", d, -1)
                if key not in shared:
                    name = f"{PREFIX}_const_{d}"
                    head.append(ir.node("Constant", [], {"value": ir.tensor(np.array([d], np.int64), name=name)},
                                        outputs=[ir.Value(name=name)]))
                    shared[key] = head[-1].outputs[0]
                return shared[key]
            if isinstance(d, str) and d in sources:
                source, axis = sources[d]
                key = ("input", source.name, axis)
                if key not in shared:
                    head.append(ir.node("Shape", [source], {"start": axis, "end": axis + 1},
                                        outputs=[ir.Value(name=f"{PREFIX}_{source.name}_{axis}")],
                                        name=f"{PREFIX}/{source.name}/{axis}"))
                    shared[key] = head[-1].outputs[0]
                return shared[key]
            return None

        def scalar_source(d) -> ir.Value | None:  # a rank-0 int64 version of dim_source(d)
            one = dim_source(d)
            if one is None:
                return None
            key = ("scalar", one.name, -2)
            if key not in shared:
                head.append(ir.node("Squeeze", [one], outputs=[ir.Value(name=one.name + "_scalar")]))
                shared[key] = head[-1].outputs[0]
            return shared[key]

        def const(value: ir.Value | None) -> np.ndarray | None:  # int64 initializers, any Constant
            if value is None:
                return None
            if value.is_initializer() and (value.dtype != ir.DataType.INT64):
                return None
            return small_array(value)

        kept: dict[ir.Value, tuple[list, bool]] = {}  # Shape output left in place -> (its dims, of a graph input)
        rewritten = 0
        for node in list(graph):
            if node.op_type == "Gather" and node.inputs[0] in kept and (idx := const(node.inputs[1])) is not None:
                d, own = kept[node.inputs[0]]
                if own or idx.ndim > 1 or any(not -len(d) <= i < len(d) for i in idx.reshape(-1)):
                    continue
                picked = [d[int(i)] for i in idx.reshape(-1)]
                parts = [scalar_source(p) if idx.ndim == 0 else dim_source(p) for p in picked]
                if any(p is None for p in parts):
                    continue
                rewritten += 1
                _rewrite(graph, node, parts)
                continue
            if node.op_type != "Shape" or node.domain not in STANDARD or node.inputs[0].is_initializer():
                continue  # (inference typed no initializer in the proto passes: ORT folds those itself)
            d = dims(node.inputs[0])
            if d is None:
                continue
            rank = len(d)
            start, end = (attr(node, "start", 0), attr(node, "end", rank))
            start, end = (s + rank if s < 0 else s for s in (start, end))
            start, end = max(0, min(start, rank)), max(0, min(end, rank))
            own = node.inputs[0] in inputs  # a graph input's own symbolic dim stays its own (pools may differ)
            parts = [None if own and not isinstance(x, int) else dim_source(x) for x in d[start:end]]
            out = node.outputs[0]
            if parts and all(p is not None for p in parts):
                rewritten += 1
                out = _rewrite(graph, node, parts)
            if start == 0 and end == rank:  # a Gather of it reads the one dim it needs, not this Shape
                kept[out] = (d, own)
        first = next(iter(graph), None)
        if head and first is not None:
            graph.insert_before(first, head)
        elif head:
            graph.extend(head)
        self.rewritten = rewritten
        return ir.passes.PassResult(model, modified=bool(rewritten))


def _rewrite(graph: ir.Graph, node: ir.Node, parts: list[ir.Value]) -> ir.Value:
    """``node``'s one output computed as ``Identity(part)`` or ``Concat(parts, axis=0)`` instead;
    returns the new output (it has the old one's name and readers)."""
    if len(parts) == 1:
        new = ir.node("Identity", parts, name=node.name)
    else:
        new = ir.node("Concat", parts, {"axis": 0}, name=node.name)
    replace(graph, node, [new], [new.outputs[0]])
    return new.outputs[0]
