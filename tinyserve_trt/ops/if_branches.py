"""An ``If`` node of a function body whose branches are written with the same GraphBuilder.

``if_branches(b, cond, then_fn, else_fn, ...)`` runs each ``*_fn()`` with ``b``
appending into a fresh node list, so a branch reads like the straight-line body
it replaces and may use any value computed before it (outer scope). Nodes of a
branch that read only per-step values - the step inputs (page table, past
lengths, budget), constants, shapes and what those make - are hoisted in front
of the ``If``: they compute the same thing in either branch, and an exporter can
still merge them across layers (``export/shared_shapes.py``, ORT's CSE), which it
cannot do inside a subgraph. What reads a layer's tensors stays in its branch, so
the branch not taken costs nothing.

Each ``*_fn`` returns ``{key: value name}`` for the same ``keys``; the ``If``'s
outputs are returned under those keys. Builds protos only.
"""

from __future__ import annotations

import onnx
from onnx import helper

from . import schema


def if_branches(b, cond: str, then_fn, else_fn, types: dict[str, int], step_inputs,
                names: dict[str, str] | None = None) -> dict[str, str]:
    """``If(cond)`` over the two branches; ``types``: ONNX elem type of each output key (in
    order; None: left to inference, e.g. a pool's dtype); ``step_inputs``: the function
    inputs that are per-step (not a layer's); ``names``: fixed output names by key (e.g.
    the op's own outputs)."""
    outer = b.nodes
    available = set(schema.INPUT_NAMES) | {o for n in outer for o in n.output}
    layer = set(schema.INPUT_NAMES) - set(step_inputs)
    for node in outer:
        if node.op_type != "Shape" and any(i in layer for i in node.input):
            layer.update(node.output)
    branches = []
    for side, build in (("then", then_fn), ("else", else_fn)):
        b.nodes = []
        try:
            out = build()
            made = b.nodes
        finally:
            b.nodes = outer
        kept, local = [], set()
        for node in made:
            reads_layer = node.op_type != "Shape" and any(i in layer for i in node.input)
            if all(i in available or not i for i in node.input) and not reads_layer and not _has_subgraph(node):
                outer.append(node)  # per-step: before the If
                available.update(node.output)
            else:
                kept.append(node)
                local.update(node.output)
                layer.update(node.output)
        outputs = []
        for key in types:
            name = out[key]
            if name not in local:  # a branch output must be made inside the branch
                name = b._name(f"{side}_{key}")
                kept.append(helper.make_node("Identity", [out[key]], [name]))
            outputs.append(helper.make_tensor_value_info(name, types[key], None) if types[key] is not None
                           else helper.make_empty_tensor_value_info(name))  # a type the inputs decide
        branches.append(helper.make_graph(kept, f"{side}_branch", [], outputs))
    names = names or {}
    results = [names.get(key) or b._name(f"if_{key}") for key in types]
    b.nodes.append(helper.make_node("If", [cond], results, then_branch=branches[0], else_branch=branches[1]))
    return dict(zip(types, results))


def _has_subgraph(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
