"""Drop the ``Identity`` nodes that only rename a value to a graph output's name.

The rewrite names each layer's new key and value rows as graph outputs through an
``Identity`` (``kv_io.py``: ``new_key.i = Identity(rotated key)``) and the portable model
keeps them. ORT removes no ``Identity`` whose output is a graph output, so every decode step
ran two copies per layer (SmolLM2: 60 nodes, ~0.6 ms of a 25 ms step at 512 under the
profiler, benchmarks/results/decode_profile.md). :class:`DropOutputIdentities` gives the
copied value the output's name instead and removes the node: same outputs, same names.

An onnx-ir pass of the ORT graph's pipeline (``ort_passes.py``), last. The value keeps its
other readers (they read it under its new name). Skipped: a value that is a graph input, an
initializer or already a graph output (it would need two names), or made in a subgraph.
"""

from __future__ import annotations

import onnx_ir as ir

from .ir_graph import STANDARD


class DropOutputIdentities(ir.passes.InPlacePass):
    """See the module doc. ``dropped``: how many the last call removed."""

    dropped = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        outputs = list(graph.outputs)
        dropped = 0
        for node in list(graph):
            if node.op_type != "Identity" or node.domain not in STANDARD:
                continue
            out, src = node.outputs[0], node.inputs[0]
            if out not in outputs or src is None or src in outputs or src.is_graph_input() \
                    or src.is_initializer() or src.producer() is None or src.producer().graph is not graph:
                continue
            if len(out.uses()) > 0:  # a node also reads the output value: keep the copy
                continue
            name = out.name
            graph.outputs[graph.outputs.index(out)] = src
            outputs[outputs.index(out)] = src
            graph.remove(node, safe=True)
            src.name = name
            if out.type is not None:  # a graph output is typed in the file
                src.type, src.shape = out.type, out.shape
            dropped += 1
        self.dropped = dropped
        return ir.passes.PassResult(model, modified=bool(dropped))
