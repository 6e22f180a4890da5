"""Rotary as ORT's ``com.microsoft::RotaryEmbedding``, for the ORT graph.

After ``rotate_half.py`` an exporter's rotary on q and on k of every layer reads::

    f = position x inverse frequency          # [B, S, D/2], once per step
    C = Unsqueeze([Cast]([Mul](Cos(Concat(f, f)), scale)), 1)   # S likewise: [B, 1, S, D]
    out = Add(Mul(x, C), Mul(MatMul(x, R), S))    # x [B, H, S, D]; either operand order

with ``R`` the rotate_half matrix. ``RotaryEmbedding(x, rows, cos_cache, sin_cache)``
(non-interleaved) is one node instead of four (SmolLM2: 180 fewer nodes a step), as ORT
GenAI's attention does it. Its caches are this step's own tables, not a precomputed one:
``cos_cache = Reshape(Cos(f), [B*S, D/2])`` and ``rows = Reshape(Range(0, B*S), [B, S])``
index token ``(b, s)``'s row - the same cos/sin values as before, whatever rope scaling
made ``f``, with no position limit and no weight bytes. Computed once per step per ``f``.

:class:`FuseRotary` (an onnx-ir pass of ``ort_passes.py``) matches structurally (no tensor names): ``x`` float32 of rank 4 with a
static even last dim ``D``, ``R`` an initializer equal to ``rotate_half.rotation(D)``, both
``C`` and ``S`` from one ``Concat(f, f)`` on the last axis, unsqueezed at axis 1 (a Mul by a
one-element constant between, rope's attention scaling, goes into the caches).

onnxscript's ``ort_fusions.fuse_rotary_embedding`` (+ ``fuse_cos_sin_cache``) fuses none of
our graphs (test_rotary's, the fixtures', checked with onnxscript 0.7.2, before and after
``rotate_half.py``): it needs the Slice/Neg/Concat rotate_half and a precomputed cos/sin
cache indexed by ``position_ids`` (a position limit, weight bytes); ours reads this step's
``f`` and runs after rotate_half became a MatMul. Used by
``ort_graph.prepared_graph`` only; the exporter validates its result against the source.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .ir_graph import (STANDARD, CountingRewrite, attr, constant_tensor, dims, dtype, initializer, node_of,
                       small_array, use_opset)
from .rotate_half import rotation

MS_DOMAIN = "com.microsoft"
F = ir.DataType.FLOAT


class FuseRotary(CountingRewrite):
    """Rewrite every matched rotary of the main graph in place (see the module doc); the Add
    becomes the RotaryEmbedding node, the rest is left for RemoveUnusedNodesPass. Reads the
    values' inferred shapes (InferShapes before). ``count``: the last call's."""

    def rewrite(self, model: ir.Model) -> int:
        return _fuse(model)


def _fuse(model: ir.Model) -> int:
    graph = model.graph

    def ints(v):
        a = small_array(v, max_size=4)
        return None if a is None else [int(x) for x in a.reshape(-1)]

    def scalar(v) -> bool:  # a one-element float32 constant (rope's attention scaling)
        t = constant_tensor(v)
        return t is not None and t.dtype == F and t.size == 1

    def trig(v, d: int):
        """(Cos | Sin, f, scale or None) when v = Unsqueeze([Cast]([Mul](Trig(Concat(f, f)), scale)), 1)."""
        u = node_of(v, "Unsqueeze")
        if u is None:
            return None
        axes = ints(u.inputs[1]) if len(u.inputs) > 1 else attr(u, "axes")
        if list(axes or []) != [1]:
            return None
        src = u.inputs[0]
        cast = node_of(src, "Cast")
        if cast is not None and attr(cast, "to") == F:
            src = cast.inputs[0]
        scale, mul = None, node_of(src, "Mul")
        if mul is not None:
            for a, b in (mul.inputs, mul.inputs[::-1]):
                if scalar(b):
                    src, scale = a, b
                    break
        t = src.producer() if src is not None else None
        if t is None or t.op_type not in ("Cos", "Sin") or t.domain not in STANDARD:
            return None
        cat = node_of(t.inputs[0], "Concat")
        if cat is None or len(cat.inputs) != 2 or cat.inputs[0] is not cat.inputs[1]:
            return None
        f = cat.inputs[0]
        fd = dims(f)
        if dtype(f) != F or not fd or len(fd) != 3 or attr(cat, "axis") not in (-1, 2) or fd[-1] not in (d // 2, None):
            return None
        return t.op_type, f, scale

    def is_rotation(v, d: int) -> bool:
        r = small_array(v) if v is not None and v.is_initializer() else None
        return r is not None and list(r.shape) == [d, d] and np.array_equal(r, rotation(d))

    def pairs(v):  # (operand, other) of a Mul, both orders
        m = node_of(v, "Mul")
        return [] if m is None or len(m.inputs) != 2 else [(m.inputs[0], m.inputs[1]), (m.inputs[1], m.inputs[0])]

    def match(add):  # (x, (f, cos scale, sin scale), D) of a rotary ending in ``add``, else None
        for rot_mul, plain_mul in ((add.inputs[1], add.inputs[0]), (add.inputs[0], add.inputs[1])):
            for rotated, s in pairs(rot_mul):
                mm = node_of(rotated, "MatMul")
                if mm is None:
                    continue
                x = mm.inputs[0]
                xd = dims(x)
                if dtype(x) != F or not xd or len(xd) != 4 or not isinstance(xd[-1], int) or xd[-1] % 2:
                    continue
                d = xd[-1]
                sin = trig(s, d)
                if not is_rotation(mm.inputs[1], d) or sin is None or sin[0] != "Sin":
                    continue
                for operand, c in pairs(plain_mul):
                    cos = trig(c, d)
                    if operand is x and cos is not None and cos[0] == "Cos" and cos[1] is sin[1]:
                        return x, (cos[1], cos[2], sin[2]), d
        return None

    tables: dict[tuple, tuple] = {}  # (f, cos scale, sin scale) -> (rows, cos_cache, sin_cache)
    count = 0
    for node in list(graph):
        found = match(node) if node.op_type == "Add" and node.domain in STANDARD and len(node.inputs) == 2 else None
        if found is None:
            continue
        x, f, d = found
        new = []
        if f not in tables:
            new = _step_tables(graph, *f, d, len(tables))
            tables[f] = (new[-1].outputs[0], new[-3].outputs[0], new[-2].outputs[0])
        rows, cos, sin = tables[f]
        out = node.outputs[0]
        rope = ir.node("RotaryEmbedding", [x, rows, cos, sin], {"interleaved": 0}, domain=MS_DOMAIN,
                       name=f"tinyserve_rotary/{out.name}")
        ir.convenience.replace_nodes_and_values(graph, node, [node], new + [rope], [out], [rope.outputs[0]])
        count += 1
    if count:
        use_opset(model, MS_DOMAIN, 1)
    return count


def _step_tables(graph: ir.Graph, f: ir.Value, cos_scale: ir.Value | None, sin_scale: ir.Value | None, d: int,
                 k: int) -> list[ir.Node]:
    """Nodes computing, from ``f`` ``[B, S, D/2]``: the cos and sin caches ``[B*S, D/2]`` (times
    their scales, if any) and the rows ``[B, S]`` = ``0 .. B*S-1`` (the last three outputs: cos,
    sin, rows)."""
    p = f"tinyserve_rotary{k}"

    def named(op, inputs, name, attrs=None):
        return ir.node(op, inputs, attrs, outputs=[ir.Value(name=f"{p}_{name}")])

    shape = initializer(graph, f"{p}_cache_shape", np.array([-1, d // 2], np.int64))
    zero = initializer(graph, f"{p}_zero", np.array(0, np.int64))
    one = initializer(graph, f"{p}_one", np.array(1, np.int64))
    bs = named("Shape", [f], "bs", {"end": 2})
    n = named("ReduceProd", [bs.outputs[0]], "n", {"keepdims": 0})
    rng = named("Range", [zero, n.outputs[0], one], "range")
    nodes = [bs, n, rng]
    halves = []
    for t, op, scale in (("cos", "Cos", cos_scale), ("sin", "Sin", sin_scale)):
        raw = named(op, [f], f"{t}_raw" if scale is not None else f"{t}_half")
        nodes.append(raw)
        halves.append(raw.outputs[0])
    for i, (t, scale) in enumerate((("cos", cos_scale), ("sin", sin_scale))):
        if scale is not None:
            nodes.append(named("Mul", [halves[i], scale], f"{t}_half"))
            halves[i] = nodes[-1].outputs[0]
    nodes += [named("Reshape", [halves[0], shape], "cos_cache"), named("Reshape", [halves[1], shape], "sin_cache"),
              named("Reshape", [rng.outputs[0], bs.outputs[0]], "rows")]
    return nodes
