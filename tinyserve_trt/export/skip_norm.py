"""Residual Add + RMSNorm as ORT's ``SkipSimplifiedLayerNormalization``, for the ORT graph.

A LLaMA-style block adds the residual and normalizes the sum twice per layer::

    s = Add(a, b)                                  # the residual stream
    x = [Cast(s, to=float)]
    r = Div(1, Sqrt(Add(ReduceMean(Pow(x, 2), axes=[-1]), eps)))   # or Reciprocal(Sqrt(..))
    y = Mul(w, [Cast](Mul(x, r)))                  # either operand order

ORT's CPU optimizer turns the norm into ``SimplifiedLayerNormalization`` but leaves the
Add apart (SmolLM2: 60 Adds a step). ``com.microsoft::SkipSimplifiedLayerNormalization(a,
b, w, epsilon)`` computes both in one pass and also returns the sum ``s`` (its 4th output),
which the next residual Add reads - as ORT GenAI's builder emits it.

:class:`FuseSkipRmsNorm` (an onnx-ir pass of ``ort_passes.py``) matches structurally (no tensor names): float32 ``a``/``b`` of
rank 3 with a static last dim ``D`` (neither a constant), ``w`` a float32 ``[D]`` initializer,
``Pow``'s exponent 2, ``ReduceMean`` over the last axis with keepdims, ``Div``'s numerator
1, a scalar ``eps``. The Add becomes the fused node (so ``s`` and ``y`` exist where ``s``
did); the final Mul is dropped, the rest of the norm is left for dead-node removal.

onnxscript's ``ort_fusions`` (``fuse_rms_normalization`` then ``fuse_skip_rms_normalization``)
fuses none of our graphs (0 of the 2 on test_skip_norm's, 0 on the fixtures' and SmolLM2's
legacy exports, checked with onnxscript 0.7.2): its RMSNorm pattern wants ``Reciprocal(Sqrt)``
(the legacy exporter writes ``Div(1, Sqrt)``), a ``ReduceMean`` axes input (opset 17 has the
attribute) and an exponent it can read as a constant (ours is a ``Constant`` node). Used
by ``ort_graph.prepared_graph`` only (the CPU EP's graph): ``model.onnx`` keeps standard
ops, and the exporter validates the prepared graph against the source.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .ir_graph import STANDARD, CountingRewrite, attr, constant_tensor, dims, dtype, node_of, small_array, use_opset

MS_DOMAIN = "com.microsoft"
FUSED = "SkipSimplifiedLayerNormalization"
F = ir.DataType.FLOAT


class FuseSkipRmsNorm(CountingRewrite):
    """Rewrite every matched residual Add + RMSNorm of the main graph in place (see the module
    doc); reads the values' inferred shapes (InferShapes before). ``count``: the last call's."""

    def rewrite(self, model: ir.Model) -> int:
        return _fuse(model)


def _fuse(model: ir.Model) -> int:
    graph = model.graph

    def value(v) -> np.ndarray | None:  # a one-element constant's value (never external data)
        return small_array(v, max_size=1)

    def scalar_is(v, want: float) -> bool:
        x = value(v)
        return x is not None and x.size == 1 and float(x.reshape(-1)[0]) == want

    def through_float_cast(v):  # x = Cast(s, to=float) -> s; else x
        n = node_of(v, "Cast")
        return n.inputs[0] if n is not None and attr(n, "to") == F else v

    def residual_operand(v, d: list) -> bool:
        """An operand of the residual Add ``[B, S, D]``: float32, not a constant (a bias would
        broadcast), and of rank 3 with the same ``D`` where its shape was inferred (ORT's kernel
        rejects a skip it cannot add, so an unproven operand fails loudly, never silently)."""
        got = dims(v)
        if v is None or constant_tensor(v) is not None or dtype(v) not in (F, None) or len(d) != 3:
            return False
        return got is None or (len(got) == 3 and got[-1] == d[-1])

    def norm_parts(mul):  # (s, eps, w) of a matched norm ending in ``mul``, else None
        for w, y in (mul.inputs, mul.inputs[::-1]):
            t = constant_tensor(w)
            if t is None or t.dtype != F or len(t.shape) != 1:
                continue
            inner = node_of(through_float_cast(y), "Mul")
            if inner is None:
                continue
            for x, r in (inner.inputs, inner.inputs[::-1]):
                parts = _rms(x, r)
                if parts is not None and t.shape[0] == parts[2]:
                    return parts[0], parts[1], w
        return None

    def _rms(x, r):  # (s, eps, D) when r = 1 / sqrt(mean(x^2) + eps) over the last axis
        recip = node_of(r, "Reciprocal")
        if recip is not None:
            sqrt = node_of(recip.inputs[0], "Sqrt")
        else:
            div = node_of(r, "Div")
            sqrt = node_of(div.inputs[1], "Sqrt") if div is not None and scalar_is(div.inputs[0], 1.0) else None
        add = node_of(sqrt.inputs[0], "Add") if sqrt is not None else None
        if add is None:
            return None
        for mean_v, eps_v in (add.inputs, add.inputs[::-1]):
            mean, eps = node_of(mean_v, "ReduceMean"), value(eps_v)
            if mean is None or eps is None or eps.size != 1:
                continue
            pw = node_of(mean.inputs[0], "Pow")
            axes = attr(mean, "axes") if len(mean.inputs) < 2 else small_array(mean.inputs[1])
            if pw is None or pw.inputs[0] is not x or not scalar_is(pw.inputs[1], 2.0) or attr(mean, "keepdims", 1) != 1:
                continue
            s = through_float_cast(x)
            d = dims(s)
            if dtype(s) != F:
                continue
            if not d or not isinstance(d[-1], int) or axes is None:
                continue
            if [int(a) for a in np.asarray(axes).reshape(-1)] not in ([-1], [len(d) - 1]):
                continue
            return s, float(eps.reshape(-1)[0]), d[-1]
        return None

    rewrites, adds = [], set()  # (residual Add node, norm's final Mul, eps, w); the Adds' outputs
    for node in graph:
        if node.op_type != "Mul" or node.domain not in STANDARD or len(node.inputs) != 2:
            continue
        parts = norm_parts(node)
        if parts is None:
            continue
        s, eps, w = parts
        add = node_of(s, "Add")
        if add is None or len(add.inputs) != 2:
            continue
        if s in adds or not all(residual_operand(i, dims(s)) for i in add.inputs):
            continue
        adds.add(s)
        rewrites.append((add, node, eps, w))

    for add, mul, eps, w in rewrites:
        y, s = mul.outputs[0], add.outputs[0]
        fused = ir.node(FUSED, [add.inputs[0], add.inputs[1], w], {"epsilon": eps}, domain=MS_DOMAIN,
                        num_outputs=4, name=f"tinyserve_skip_rms_norm/{y.name}")
        for unused in fused.outputs[1:3]:
            unused.name = ""
        # the fused node stands where the Add was: y and s exist where s did
        ir.convenience.replace_nodes_and_values(graph, add, [add], [fused], [s], [fused.outputs[3]])
        ir.convenience.replace_all_uses_with(y, fused.outputs[0], replace_graph_outputs=True)
        name, y.name = y.name, None
        graph.remove(mul, safe=True)
        fused.outputs[0].name = name
        fused.outputs[0].type, fused.outputs[0].shape = y.type, y.shape
    if rewrites:
        use_opset(model, MS_DOMAIN, 1)
    return len(rewrites)
