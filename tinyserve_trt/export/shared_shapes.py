"""Resolve ``Shape`` nodes to constants or to a graph input's dim, so ORT merges per-layer bookkeeping.

After the op's function is inlined, every layer computes the same per-step page
metadata (page counts, valid / forced pages, keep counts, the dense switch, the
rank masks) from dims it reads with ``Shape`` nodes. ORT's common-subexpression
elimination merges nodes only when their inputs are the same values, and ORT
folds a ``Shape`` only when its input's whole shape is static - so each layer's
``Shape(key_cache.i)`` / ``Shape(query_i)`` keeps a private copy of everything
downstream (~125 nodes per layer for SmolLM2).

:func:`share_shape_dims` uses the model's inferred shapes: a ``Shape`` node whose
dims are all static becomes a constant; a dim named by a symbolic parameter that
a graph input also has (``sequence_length`` of ``input_ids``, ``batch`` of
``page_table``) is read off that input instead (one ``Shape`` per input dim, shared).
ORT's constant folding and CSE then compute the metadata once per step.

Only for the ORT-optimized graph (``ort_graph.py``): the portable model keeps its
Shapes. Sound where shape inference is (equal dim names are equal sizes); the
exporter validates the resulting graph against the source like the portable one.
"""

from __future__ import annotations

from contextlib import contextmanager

import onnx
from onnx import helper, numpy_helper

import numpy as np

PREFIX = "tinyserve_shared_shape"


def _dims(vi: onnx.ValueInfoProto) -> list | None:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]


@contextmanager
def weights_detached(model: onnx.ModelProto):
    """Large initializers' bytes taken out for the block (copying and typing read none);
    yields name -> bytes; restores them after."""
    big = [(t, t.raw_data) for t in model.graph.initializer if len(t.raw_data) > (1 << 16)]
    try:
        for t, _ in big:
            t.ClearField("raw_data")
        yield {t.name: data for t, data in big}
    finally:
        for t, data in big:
            t.raw_data = data


def inferred(model: onnx.ModelProto) -> dict[str, tuple[int, list | None]]:
    """Value name -> (ONNX elem type, dims: int, dim_param str or None) by ONNX shape inference
    with data propagation. Does not modify ``model``."""
    from onnx import shape_inference

    with weights_detached(model):
        typed = shape_inference.infer_shapes(model, data_prop=True)
    return {vi.name: (vi.type.tensor_type.elem_type, _dims(vi))
            for vi in [*typed.graph.input, *typed.graph.value_info, *typed.graph.output]}


def share_shape_dims(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Inline local functions, infer shapes, and rewrite resolvable ``Shape`` nodes in the
    main graph (see the module doc). Returns (new model, Shape nodes rewritten). Does not
    modify ``model``; reads no external data."""
    from onnx import inliner

    with weights_detached(model) as big:
        inlined = inliner.inline_local_functions(model)
    for t in inlined.graph.initializer:
        if t.name in big:
            t.raw_data = big[t.name]
    typed = inferred(inlined)
    shapes = {name: dims for name, (_, dims) in typed.items()}
    sources: dict[str, tuple[str, int]] = {}  # dim_param -> (graph input, axis)
    for vi in inlined.graph.input:
        for axis, d in enumerate(shapes.get(vi.name) or []):
            if isinstance(d, str):
                sources.setdefault(d, (vi.name, axis))

    graph = inlined.graph
    inputs = {vi.name for vi in graph.input}
    shared: dict[tuple[str, int], str] = {}  # (input, axis) -> its Shape output
    head: list[onnx.NodeProto] = []
    nodes: list[onnx.NodeProto] = []
    rewritten = 0

    def dim_source(d) -> str | None:
        if isinstance(d, int) and not isinstance(d, bool) and d > 0:
            name = f"{PREFIX}_const_{d}"
            if (name, -1) not in shared:
                head.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
                    np.array([d], np.int64), name)))
                shared[(name, -1)] = name
            return name
        if isinstance(d, str) and d in sources:
            key = sources[d]
            if key not in shared:
                out = f"{PREFIX}_{key[0]}_{key[1]}"
                head.append(helper.make_node("Shape", [key[0]], [out], start=key[1], end=key[1] + 1,
                                             name=f"{PREFIX}/{key[0]}/{key[1]}"))
                shared[key] = out
            return shared[key]
        return None

    def scalar_source(d) -> str | None:  # a rank-0 int64 version of dim_source(d)
        one = dim_source(d)
        if one is None:
            return None
        name = one + "_scalar"
        if (name, -2) not in shared:
            head.append(helper.make_node("Squeeze", [one], [name]))
            shared[(name, -2)] = name
        return name

    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer if t.data_type == onnx.TensorProto.INT64}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            consts[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    kept_shapes: dict[str, tuple[list, bool]] = {}  # Shape output left in place -> (its dims, of a graph input)

    for node in graph.node:
        if node.op_type == "Gather" and node.input[0] in kept_shapes and node.input[1] in consts:
            dims, own = kept_shapes[node.input[0]]
            idx = consts[node.input[1]]
            if own or idx.ndim > 1 or any(not -len(dims) <= i < len(dims) for i in idx.reshape(-1)):
                nodes.append(node)
                continue
            picked = [dims[int(i)] for i in idx.reshape(-1)]
            parts = [scalar_source(d) if idx.ndim == 0 else dim_source(d) for d in picked]
            if any(p is None for p in parts):
                nodes.append(node)
                continue
            rewritten += 1
            op = "Identity" if len(parts) == 1 else "Concat"
            extra = {} if op == "Identity" else {"axis": 0}
            nodes.append(helper.make_node(op, parts, list(node.output), name=node.name, **extra))
            continue
        dims = shapes.get(node.input[0]) if node.op_type == "Shape" and node.domain in ("", "ai.onnx") else None
        if dims is None:
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        rank = len(dims)
        start, end = attrs.get("start", 0), attrs.get("end", rank)
        start, end = (s + rank if s < 0 else s for s in (start, end))
        start, end = max(0, min(start, rank)), max(0, min(end, rank))
        own = node.input[0] in inputs  # a graph input's own symbolic dim stays its own (pools may differ)
        parts = [None if own and not isinstance(d, int) else dim_source(d) for d in dims[start:end]]
        if start == 0 and end == rank:  # a Gather of it reads the one dim it needs, not this Shape
            kept_shapes[node.output[0]] = (dims, own)
        if not parts or any(p is None for p in parts):
            nodes.append(node)
            continue
        rewritten += 1
        if len(parts) == 1:
            nodes.append(helper.make_node("Identity", parts, list(node.output), name=node.name))
        else:
            nodes.append(helper.make_node("Concat", parts, list(node.output), axis=0, name=node.name))
    del graph.node[:]
    graph.node.extend(live(head + nodes, {o.name for o in graph.output}))
    return inlined, rewritten


def live(nodes: list, outputs: set[str]) -> list:
    """``nodes`` without those whose outputs nothing reads (ORT keeps a dead ``Shape``)."""
    needed, kept = set(outputs), []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(node.input)
            needed.update(_subgraph_reads(node))
    return kept[::-1]


def _subgraph_reads(node) -> set[str]:
    """Names the subgraphs of ``node`` (an If's branches) read, their own values included:
    the outer values among them must stay alive."""
    out = set()
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            for n in g.node:
                out.update(n.input)
                out.update(_subgraph_reads(n))
            out.update(o.name for o in g.output)
    return out
