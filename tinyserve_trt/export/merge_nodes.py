"""Merge identical nodes of the main graph (common subexpressions), subgraph readers included.

Every layer's inlined op computes the same per-step values (page counts, masks,
the dense switch, gather row ids) from the same graph inputs; ONNX Runtime's CSE
merges those, but not a value that an ``If`` branch reads from the outer scope
(it logs "Implicit input name ... cannot be safely updated" and keeps all 28
copies). :func:`merge_identical_nodes` does the merge itself before ORT sees the
graph: a node whose op, domain, attributes and (already merged) inputs equal an
earlier node's is dropped and its outputs renamed to the earlier one's, in the
nodes after it and inside every subgraph that reads them. Nodes with subgraphs
and nonsymmetric ops (random generators) are never merged; graph outputs keep
their names. Used by ``ort_graph.prepared_graph``; the exporter validates its result.
"""

from __future__ import annotations

import onnx

NEVER = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}


def merge_identical_nodes(model: onnx.ModelProto) -> int:
    """Merge in place; returns the number of nodes removed."""
    graph = model.graph
    keep_names = {o.name for o in graph.output}
    renamed: dict[str, str] = {}
    seen: dict[tuple, list[str]] = {}
    kept = []
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            _rename_in_subgraphs(node, renamed)
            kept.append(node)
            continue
        key = (node.domain, node.op_type, tuple(node.input), tuple(a.SerializeToString() for a in node.attribute))
        earlier = seen.get(key) if node.op_type not in NEVER else None
        if earlier is None or any(o in keep_names for o in node.output) or len(earlier) != len(node.output):
            seen.setdefault(key, list(node.output))
            kept.append(node)
            continue
        renamed.update((o, e) for o, e in zip(node.output, earlier) if o)
    removed = len(graph.node) - len(kept)
    del graph.node[:]
    graph.node.extend(kept)
    return removed


def _rename_in_subgraphs(node: onnx.NodeProto, renamed: dict[str, str]) -> None:
    """Outer-scope reads inside ``node``'s subgraphs follow the merge (their own values are
    never in ``renamed``: names are unique across a model)."""
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            for n in g.node:
                for i, name in enumerate(n.input):
                    if name in renamed:
                        n.input[i] = renamed[name]
                _rename_in_subgraphs(n, renamed)
            for o in g.output:
                if o.name in renamed:  # a branch that returns an outer value as is
                    o.name = renamed[o.name]
