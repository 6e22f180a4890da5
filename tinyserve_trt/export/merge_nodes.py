"""Merge identical nodes of the main graph (common subexpressions), subgraph readers included.

Every layer's inlined op computes the same per-step values (page counts, masks,
the dense switch, gather row ids) from the same graph inputs; ONNX Runtime's CSE
merges those, but not a value that an ``If`` branch reads from the outer scope
(it logs "Implicit input name ... cannot be safely updated" and keeps all 28
copies). :class:`MergeIdenticalNodes` (an onnx-ir pass of ``ort_passes.py``) does the
merge before ORT sees the graph: a node whose op, domain, attributes and (already
merged) inputs equal an earlier node's is dropped and its outputs' readers - inside
every subgraph too, an onnx-ir value being one object in all scopes - read the
earlier one's. Nodes with subgraphs and nonsymmetric ops (random generators) are
never merged; a node that makes a graph output is kept, so outputs keep their names.

Not onnx-ir's ``CommonSubexpressionEliminationPass``: that one merges a graph output's
node too and renames the kept value to the output's name (a graph input's or another
output's value gets an Identity), which changes the names the layers' values have.
"""

from __future__ import annotations

import onnx_ir as ir

NEVER = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}


class MergeIdenticalNodes(ir.passes.InPlacePass):
    """Merge in place (see the module doc); ``removed``: the nodes the last call dropped."""

    removed = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        outputs = set(graph.outputs)
        seen: dict[tuple, ir.Node] = {}
        dropped = []
        for node in list(graph):
            if node.op_type in NEVER or any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
                                            for a in node.attributes.values()):
                continue
            key = (node.domain, node.op_type, node.overload, len(node.outputs),
                   tuple(id(v) if v is not None else None for v in node.inputs),
                   tuple(ir.serde.serialize_attribute(a).SerializeToString() for a in node.attributes.values()))
            earlier = seen.get(key)
            if earlier is None or any(o in outputs for o in node.outputs):
                seen.setdefault(key, node)
                continue
            for old, new in zip(node.outputs, earlier.outputs):
                old.replace_all_uses_with(new)
            dropped.append(node)
        graph.remove(dropped, safe=True)  # at once: one by one, each removal walks the graph
        self.removed = len(dropped)
        return ir.passes.PassResult(model, modified=bool(dropped))
