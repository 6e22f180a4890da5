"""Pack the projections that read one activation into one MatMul (QKV; gate/up).

A decoder layer multiplies the same normed hidden state by the Q, K and V
weights, and later by the gate and up weights: five MatMuls of which the K/V
ones are skinny (SmolLM2: 576 x 192). At decode (one row per sequence) each is
a matrix-vector product whose cost is its weight bytes plus a fixed per-node
overhead, so three nodes over the same bytes cost more than one. ORT GenAI's
builder packs them the same way.

:func:`pack_shared_matmuls` rewrites every group of >= 2 ``MatMul(x, W_i)`` in
the main graph that share ``x`` and whose ``W_i`` are 2-D float initializers of
the same dtype and row count, each read by that MatMul only, into
``MatMul(x, concat(W_i, axis=1))`` followed by a ``Split`` on the last axis
whose outputs keep the original MatMuls' names. The concatenated initializer
REPLACES the originals (the package keeps one copy of the weights). Each output
column is the same dot product as before; the exporter validates the result
against the source. Standard ops only, so TensorRT reads the same graph.

A proto pass of the rewrite stage (``pipeline.py``, on ``model.onnx`` before it is
written), not one of the ORT graph's onnx-ir post-passes (``ort_passes.py``): it is the
one pass that reads and concatenates weight bytes, and an onnx-ir tensor of them would
be copied once more by ``ir.to_proto`` while the IR model still holds it.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
from pathlib import Path

import onnx
from onnx import helper, numpy_helper

from .weights import read_array

SPLIT_INPUT_OPSET = 13  # Split takes its sizes as an input from opset 13


def pack_shared_matmuls(model: onnx.ModelProto, base_dir: str | Path = "") -> int:
    """Pack ``model``'s main graph in place (see the module doc); returns the MatMuls removed.
    External weights are read from ``base_dir``; the packed ones are new inline tensors."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    taken = set(inits) | {v.name for v in graph.input} | {o for n in graph.node for o in n.output}
    node_names = {n.name for n in graph.node}
    uses = Counter(i for n in graph.node for i in n.input)
    uses.update(o.name for o in graph.output)
    groups: dict[str, list[int]] = defaultdict(list)
    for pos, node in enumerate(graph.node):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        w = inits.get(node.input[1])
        if w is None or len(w.dims) != 2 or uses[w.name] != 1 or w.data_type not in (
                onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16):
            continue
        groups[node.input[0]].append(pos)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    replace: dict[int, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    dropped_inits: set[str] = set()
    new_inits = []
    for x, members in groups.items():
        weights = [inits[graph.node[p].input[1]] for p in members]
        key = {(w.data_type, w.dims[0]) for w in weights}
        if len(members) < 2 or len(key) != 1:
            continue
        arrays = [read_array(w, Path(base_dir)) for w in weights]
        first = graph.node[members[0]]
        name = _unique(f"{weights[0].name}.packed", taken)
        packed = numpy_helper.from_array(np.concatenate(arrays, axis=1), name)
        packed.data_type = weights[0].data_type  # keeps bfloat16 as it was stored
        new_inits.append(packed)
        dropped_inits.update(w.name for w in weights)
        joined = _unique(f"{first.output[0]}.packed", taken)
        sizes = [int(w.dims[1]) for w in weights]
        outputs = [graph.node[p].output[0] for p in members]
        split_attrs = dict(axis=-1)
        split_inputs = [joined]
        if opset >= SPLIT_INPUT_OPSET:
            sizes_name = _unique(f"{joined}.sizes", taken)
            new_inits.append(numpy_helper.from_array(np.array(sizes, np.int64), sizes_name))
            split_inputs.append(sizes_name)
        else:
            split_attrs["split"] = sizes
        replace[members[0]] = [
            helper.make_node("MatMul", [x, name], [joined], name=_unique(f"{first.name or joined}/packed", node_names)),
            helper.make_node("Split", split_inputs, outputs, name=_unique(f"{first.name or joined}/split", node_names),
                             **split_attrs),
        ]
        drop.update(members[1:])
    if not replace:
        return 0
    nodes = []
    for pos, node in enumerate(graph.node):
        if pos in replace:
            nodes.extend(replace[pos])
        elif pos not in drop:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [t for t in graph.initializer if t.name not in dropped_inits]
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)
    return len(drop)


def _unique(name: str, taken: set[str]) -> str:
    """``name``, suffixed until no value of the graph has it; reserved in ``taken``."""
    out, i = name, 0
    while out in taken:
        i += 1
        out = f"{name}.{i}"
    taken.add(out)
    return out
