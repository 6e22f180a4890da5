"""The ORT graph's post-passes: one ordered list of onnx-ir passes over one ``onnx_ir.Model``.

``ort_graph.prepared_graph`` converts the (opset-raised) portable model to an
``onnx_ir.Model`` once, runs :func:`post_passes` in one ``ir.passes.PassManager`` and
serializes once. Weights stay where they are: an external initializer is an
``ir.ExternalTensor`` that no pass reads (only inline constants of a few elements
are), and serializing writes its reference back, not its bytes.

In order, and why there:

1. ``native_switch.ReplaceNativeCalls`` (``native``): the op nodes the native CPU kernel
   takes become its node, for every S, before inlining would dissolve them.
2. onnx-ir ``InlinePass``: the op's functions (and any other local function) inlined, after
   :class:`NameFunctionNodes` names their unnamed nodes.
3. ``inferred_shapes.InferShapes``: onnx's shape inference (data propagation on, weights left
   out) types the main graph's values.
4. ``shared_shapes.ShareShapeDims``: resolvable ``Shape`` nodes become constants or a
   graph input's dim, then onnx-ir ``RemoveUnusedNodesPass`` drops the dead Shapes.
5. ``merge_nodes.MergeIdenticalNodes``: the layers' per-step values merged,
   also those If branches read.
6. ``InferShapes`` again: the merged graph's shapes (folded Shapes resolve more dims).
7. ``rotate_half.FuseRotateHalf``; with ``contrib_ops``, ``skip_norm.FuseSkipRmsNorm`` and
   ``rotary.FuseRotary`` (which reads the MatMuls rotate_half made).
8. ``native_layer.FuseNativeLayer`` (``native``): each native node with its layer's head split,
   rotary and transposes as one layer node (after the rotary fusion it absorbs);
   ``RemoveUnusedNodesPass``.
9. ``output_identities.DropOutputIdentities`` last: the Identity copies that only name the new
   key / value rows as graph outputs (ORT keeps every one, two per layer per step) removed.

The fusions are our own patterns, not onnxscript's rewriter: its ``ort_fusions`` match none
of our graphs (``skip_norm.py``, ``rotary.py`` say why).
"""

from __future__ import annotations

import onnx_ir as ir


class NameFunctionNodes(ir.passes.InPlacePass):
    """Name each unnamed node of the model's local functions ``f<k>.<i>`` (short: the names
    are written into ``model.ort.onnx``, once per layer).

    onnx-ir's InlinePass names an inlined node after its original, adding the first free
    ``_<k>`` suffix by counting up: the op's body nodes are unnamed (all "node"), so each call
    scanned every suffix taken before - quadratic, 12 s of SmolLM2's 13 s ``prepared_graph``.
    Named, a name collides once per layer. Node names carry no meaning here."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        named = 0
        for k, function in enumerate(model.functions.values()):
            for i, node in enumerate(function.all_nodes()):
                if not node.name:
                    node.name = f"f{k}.{i}"
                    named += 1
        return ir.passes.PassResult(model, modified=bool(named))


def post_passes(contrib_ops: bool = True, native: bool = False) -> list:
    """The passes above, as instances (each an ``ir.passes.PassBase``), in order."""
    from onnx_ir.passes.common import InlinePass, RemoveUnusedNodesPass

    from .inferred_shapes import InferShapes
    from .merge_nodes import MergeIdenticalNodes
    from .rotate_half import FuseRotateHalf
    from .shared_shapes import ShareShapeDims

    passes = []
    if native:
        from .native_switch import ReplaceNativeCalls

        passes.append(ReplaceNativeCalls())
    passes += [NameFunctionNodes(), InlinePass(), InferShapes(), ShareShapeDims(), RemoveUnusedNodesPass(), MergeIdenticalNodes(),
               InferShapes(), FuseRotateHalf()]
    if contrib_ops:
        from .rotary import FuseRotary
        from .skip_norm import FuseSkipRmsNorm

        passes += [FuseSkipRmsNorm(), FuseRotary()]
    if native:
        from .native_layer import FuseNativeLayer

        passes.append(FuseNativeLayer())
    passes.append(RemoveUnusedNodesPass())
    from .output_identities import DropOutputIdentities

    passes.append(DropOutputIdentities())
    return passes


def run_post_passes(model, contrib_ops: bool = True, native: bool = False):
    """``model`` (an ``onnx.ModelProto``, weights inline or external) with :func:`post_passes`
    applied: converted to onnx-ir once, serialized once. Does not modify ``model``."""
    import onnx_ir as ir

    work = ir.serde.deserialize_model(model)
    ir.passes.PassManager(post_passes(contrib_ops, native))(work)
    for v in work.graph.initializers.values():  # a tensor carries its own type: onnx-ir would also
        if not (v.is_graph_input() or v.is_graph_output()):  # write each as value_info, which ORT keeps
            v.type, v.shape = None, None
    return ir.serde.serialize_model(work)
