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

:func:`fuse_skip_rms_norm` matches structurally (no tensor names): float32 ``a``/``b`` of
rank 3 with a static last dim ``D`` (neither a constant), ``w`` a float32 ``[D]`` initializer,
``Pow``'s exponent 2, ``ReduceMean`` over the last axis with keepdims, ``Div``'s numerator
1, a scalar ``eps``. The Add becomes the fused node (so ``s`` and ``y`` exist where ``s``
did); the final Mul is dropped, the rest of the norm is left for dead-node removal. Used
by ``ort_graph.prepared_graph`` only (the CPU EP's graph): ``model.onnx`` keeps standard
ops, and the exporter validates the prepared graph against the source.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

MS_DOMAIN = "com.microsoft"
FUSED = "SkipSimplifiedLayerNormalization"


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Initializers and ``Constant`` outputs of the main graph (external data not read)."""
    out = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            out[node.output[0]] = node.attribute[0].t
    return out


def fuse_skip_rms_norm(model: onnx.ModelProto, shapes: dict[str, tuple[int, list]]) -> int:
    """Rewrite every matched residual Add + RMSNorm of ``model``'s main graph in place (see the
    module doc); ``shapes``: value name -> (ONNX elem type, inferred dims). Returns the count."""
    graph = model.graph
    consts = _constants(graph)
    producer = {o: n for n in graph.node for o in n.output if o}
    F = onnx.TensorProto.FLOAT

    def value(name: str) -> np.ndarray | None:  # a small constant's value (never external data)
        t = consts.get(name)
        if t is None or t.data_location == onnx.TensorProto.EXTERNAL or np.prod(t.dims, dtype=np.int64) > 1:
            return None
        return numpy_helper.to_array(t)

    def scalar_is(name: str, want: float) -> bool:
        v = value(name)
        return v is not None and v.size == 1 and float(v.reshape(-1)[0]) == want

    def node_of(name: str, op: str):
        n = producer.get(name)
        return n if n is not None and n.op_type == op and n.domain in ("", "ai.onnx") else None

    def through_float_cast(name: str) -> str:  # x = Cast(s, to=float) -> s; else x
        n = node_of(name, "Cast")
        if n is not None and helper.get_attribute_value(n.attribute[0]) == F:
            return n.input[0]
        return name

    def residual_operand(name: str, dims: list) -> bool:
        """An operand of the residual Add ``[B, S, D]``: float32, not a constant (a bias would
        broadcast), and of rank 3 with the same ``D`` where its shape was inferred (ORT's kernel
        rejects a skip it cannot add, so an unproven operand fails loudly, never silently)."""
        elem, got = shapes.get(name, (None, None))
        if name in consts or elem not in (F, None) or len(dims) != 3:
            return False
        return got is None or (len(got) == 3 and got[-1] == dims[-1])

    def norm_parts(mul):  # (s, eps, w) of a matched norm ending in ``mul``, else None
        for w, y in (mul.input, mul.input[::-1]):
            t = consts.get(w)
            if t is None or t.data_type != F or len(t.dims) != 1:
                continue
            inner = node_of(through_float_cast(y), "Mul")
            if inner is None:
                continue
            for x, r in (inner.input, inner.input[::-1]):
                parts = _rms(x, r)
                if parts is not None and t.dims[0] == parts[2]:
                    return parts[0], parts[1], w
        return None

    def _rms(x: str, r: str):  # (s, eps, D) when r = 1 / sqrt(mean(x^2) + eps) over the last axis
        recip = node_of(r, "Reciprocal")
        if recip is not None:
            sqrt = node_of(recip.input[0], "Sqrt")
        else:
            div = node_of(r, "Div")
            sqrt = node_of(div.input[1], "Sqrt") if div is not None and scalar_is(div.input[0], 1.0) else None
        add = node_of(sqrt.input[0], "Add") if sqrt is not None else None
        if add is None:
            return None
        for mean_name, eps_name in (add.input, add.input[::-1]):
            mean, eps = node_of(mean_name, "ReduceMean"), value(eps_name)
            if mean is None or eps is None or eps.size != 1:
                continue
            pw = node_of(mean.input[0], "Pow")
            attrs = {a.name: helper.get_attribute_value(a) for a in mean.attribute}
            axes = attrs.get("axes") if len(mean.input) < 2 else value(mean.input[1])
            if pw is None or pw.input[0] != x or not scalar_is(pw.input[1], 2.0) or attrs.get("keepdims", 1) != 1:
                continue
            s = through_float_cast(x)
            elem, dims = shapes.get(s, (None, None))
            if elem != F:
                continue
            if not dims or not isinstance(dims[-1], int) or axes is None:
                continue
            if [int(a) for a in np.asarray(axes).reshape(-1)] not in ([-1], [len(dims) - 1]):
                continue
            return s, float(eps.reshape(-1)[0]), dims[-1]
        return None

    rewrites, adds = [], set()  # (residual Add node, norm's final Mul, eps, w); the Adds' outputs
    for node in graph.node:
        if node.op_type != "Mul" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        parts = norm_parts(node)
        if parts is None:
            continue
        s, eps, w = parts
        add = node_of(s, "Add")
        if add is None or len(add.input) != 2:
            continue
        if s in adds or not all(residual_operand(i, shapes[s][1]) for i in add.input):
            continue
        adds.add(s)
        rewrites.append((add, node, eps, w))
    dead = set()  # the norms' final Mul outputs, now the fused nodes'

    for add, mul, eps, w in rewrites:
        a, b, s = add.input[0], add.input[1], add.output[0]
        fused = helper.make_node(FUSED, [a, b, w], [mul.output[0], "", "", s], domain=MS_DOMAIN,
                                 name=f"tinyserve_skip_rms_norm/{mul.output[0]}", epsilon=eps)
        dead.add(mul.output[0])
        add.Clear()
        add.CopyFrom(fused)
    if rewrites:
        kept = [n for n in graph.node if not (n.op_type == "Mul" and n.output[0] in dead)]
        del graph.node[:]
        graph.node.extend(kept)
        if not any(o.domain == MS_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return len(rewrites)
