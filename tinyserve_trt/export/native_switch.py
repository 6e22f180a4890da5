"""The ORT graph's native layers as an onnx-ir pass: each op node the native CPU kernel implements
becomes one ``tinyserve.cpu`` node, for decode steps and prefill chunks alike.

``native_decode.py`` says which nodes and why. The pass runs before ``InlinePass``: a replaced node
has no function left to inline, so none of its ~80-110 body nodes, nor the per-step values only
those read (page counts, masks), reach ``model.ort.onnx``. Node version 3 runs every S (decode:
the selection; S > 1: exact causal attention, ``cpu/csrc/qsa_prefill.h``); version 2 ran S == 1
only, so each layer was ``If(S == 1)`` with the inlined function in its prefill branch - 30 If nodes
and ~160 per-step nodes a SmolLM2 decode step ran for nothing. Reads no weights.
"""

from __future__ import annotations

import onnx_ir as ir

from ..ops import schema
from .native_decode import NATIVE_DOMAIN, ineligible, is_op


class ReplaceNativeCalls(ir.passes.InPlacePass):
    """Replace, in place, each op node of the main graph the native kernel implements by the native
    node (the same inputs at the schema's positions, attributes and output values). ``count``: the
    layers the last call replaced."""

    count = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from ..cpu.node import VERSION

        graph = model.graph
        elem_types = {v.name: int(v.dtype) for v in graph.inputs if v.dtype is not None}
        self.count = 0
        for node in list(graph):
            proto = ir.serde.serialize_node(node)
            if is_op(proto) and ineligible(proto, elem_types) is None:
                graph.insert_before(node, _native(node, proto))
                for i in range(len(node.inputs)):  # its values keep no reader that is not in the graph
                    node.replace_input_with(i, None)
                graph.remove(node, safe=False)
                self.count += 1
        if self.count:
            graph.opset_imports.setdefault(NATIVE_DOMAIN, VERSION)
        return ir.passes.PassResult(model, modified=bool(self.count))


def _native(node: ir.Node, proto) -> ir.Node:
    """The native node of op node ``node`` (``proto``: its serialized form); its output values take
    over the names, types and readers (graph outputs included) of ``node``'s."""
    from ..cpu.node import input_names, make_decode_node
    from ..ops.node import node_attributes

    attrs = node_attributes(proto)
    given = dict(zip(schema.INPUT_NAMES, node.inputs))  # the op node's inputs are in schema order
    cold = any(given.get(n) is not None for n in schema.COLD_INPUTS)
    names = input_names(attrs.two_level, cold)
    theirs = list(node.outputs)
    made = make_decode_node(list(names), [v.name or "" for v in theirs], attrs,
                            name=f"{node.name or 'qsa'}_native", cold_pages=cold)
    native = ir.Node(made.domain, made.op_type, [given.get(n) if n else None for n in names],
                     [ir.serde.deserialize_attribute(a) for a in made.attribute], name=made.name,
                     num_outputs=len(theirs))
    for mine, old in zip(native.outputs, theirs):
        ir.convenience.replace_all_uses_with(old, mine, replace_graph_outputs=True)
        name, old.name = old.name, None
        mine.name, mine.type, mine.shape = name, old.type, old.shape
    return native
