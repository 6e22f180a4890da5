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

:func:`fuse_rotary` matches structurally (no tensor names): ``x`` float32 of rank 4 with a
static even last dim ``D``, ``R`` an initializer equal to ``rotate_half.rotation(D)``, both
``C`` and ``S`` from one ``Concat(f, f)`` on the last axis, unsqueezed at axis 1 (a Mul by a
one-element constant between, rope's attention scaling, goes into the caches). Used by
``ort_graph.prepared_graph`` only; the exporter validates its result against the source.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .rotate_half import rotation

MS_DOMAIN = "com.microsoft"
F = onnx.TensorProto.FLOAT


def fuse_rotary(model: onnx.ModelProto, shapes: dict[str, tuple[int, list]]) -> int:
    """Rewrite every matched rotary of ``model``'s main graph in place (see the module doc); the
    Add becomes the RotaryEmbedding node, the rest is left for dead-node removal. ``shapes``:
    value name -> (ONNX elem type, inferred dims). Returns the count."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output if o}
    inits = {t.name: t for t in graph.initializer}

    def node_of(name: str, op: str):
        n = producer.get(name)
        return n if n is not None and n.op_type == op and n.domain in ("", "ai.onnx") else None

    def ints(name: str):
        t = inits.get(name)
        if t is None or t.data_location == onnx.TensorProto.EXTERNAL or np.prod(t.dims, dtype=np.int64) > 4:
            n = node_of(name, "Constant")
            t = n.attribute[0].t if n is not None and n.attribute[0].name == "value" else None
        return None if t is None else [int(v) for v in numpy_helper.to_array(t).reshape(-1)]

    def scalar(name: str) -> bool:  # a one-element float32 constant (rope's attention scaling)
        t = inits.get(name)
        if t is None:
            n = node_of(name, "Constant")
            t = n.attribute[0].t if n is not None and n.attribute[0].name == "value" else None
        return t is not None and t.data_type == F and int(np.prod(t.dims, dtype=np.int64)) == 1

    def trig(name: str, d: int):
        """(Cos | Sin, f, scale or None) when name = Unsqueeze([Cast]([Mul](Trig(Concat(f, f)), scale)), 1)."""
        u = node_of(name, "Unsqueeze")
        if u is None:
            return None
        axes = ints(u.input[1]) if len(u.input) > 1 else helper.get_attribute_value(u.attribute[0])
        if list(axes or []) != [1]:
            return None
        src = u.input[0]
        cast = node_of(src, "Cast")
        if cast is not None and helper.get_attribute_value(cast.attribute[0]) == F:
            src = cast.input[0]
        scale, mul = None, node_of(src, "Mul")
        if mul is not None:
            for a, b in (mul.input, mul.input[::-1]):
                if scalar(b):
                    src, scale = a, b
                    break
        t = producer.get(src)
        if t is None or t.op_type not in ("Cos", "Sin") or t.domain not in ("", "ai.onnx"):
            return None
        cat = node_of(t.input[0], "Concat")
        if cat is None or len(cat.input) != 2 or cat.input[0] != cat.input[1]:
            return None
        elem, dims = shapes.get(cat.input[0], (None, None))
        axis = helper.get_attribute_value(cat.attribute[0])
        if elem != F or not dims or len(dims) != 3 or axis not in (-1, 2) or dims[-1] not in (d // 2, None):
            return None
        return t.op_type, cat.input[0], scale

    def is_rotation(name: str, d: int) -> bool:
        t = inits.get(name)
        return (t is not None and t.data_location != onnx.TensorProto.EXTERNAL and list(t.dims) == [d, d]
                and np.array_equal(numpy_helper.to_array(t), rotation(d)))

    def pairs(name: str):  # (operand, other) of a Mul, both orders
        m = node_of(name, "Mul")
        return [] if m is None or len(m.input) != 2 else [(m.input[0], m.input[1]), (m.input[1], m.input[0])]

    def match(add):  # (x, f, D) of a rotary ending in ``add``, else None
        for rot_mul, plain_mul in ((add.input[1], add.input[0]), (add.input[0], add.input[1])):
            for rotated, s in pairs(rot_mul):
                mm = node_of(rotated, "MatMul")
                if mm is None:
                    continue
                x = mm.input[0]
                elem, dims = shapes.get(x, (None, None))
                if elem != F or not dims or len(dims) != 4 or not isinstance(dims[-1], int) or dims[-1] % 2:
                    continue
                d = dims[-1]
                if not is_rotation(mm.input[1], d) or trig(s, d) is None or trig(s, d)[0] != "Sin":
                    continue
                for operand, c in pairs(plain_mul):
                    cos, sin = trig(c, d), trig(s, d)
                    if operand == x and cos is not None and cos[0] == "Cos" and cos[1] == sin[1]:
                        return x, (cos[1], cos[2], sin[2]), d
        return None

    tables: dict[tuple, list[str]] = {}  # (f, cos scale, sin scale) -> [rows, cos_cache, sin_cache]
    new_nodes, count = [], 0
    for node in graph.node:
        found = match(node) if node.op_type == "Add" and node.domain in ("", "ai.onnx") else None
        if found is None:
            new_nodes.append(node)
            continue
        x, f, d = found
        if f not in tables:
            new_nodes += _step_tables(graph, *f, d, len(tables))
            tables[f] = [new_nodes[-1].output[0], new_nodes[-3].output[0], new_nodes[-2].output[0]]
        rows, cos, sin = tables[f]
        out = node.output[0]
        new_nodes.append(helper.make_node("RotaryEmbedding", [x, rows, cos, sin], [out], domain=MS_DOMAIN,
                                          name=f"tinyserve_rotary/{out}", interleaved=0))
        count += 1
    if count:
        del graph.node[:]
        graph.node.extend(new_nodes)
        if not any(o.domain == MS_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return count


def _step_tables(graph: onnx.GraphProto, f: str, cos_scale: str | None, sin_scale: str | None, d: int,
                 k: int) -> list:
    """Nodes computing, from ``f`` ``[B, S, D/2]``: the cos and sin caches ``[B*S, D/2]`` (times
    their scales, if any) and the rows ``[B, S]`` = ``0 .. B*S-1`` (the last three outputs: cos,
    sin, rows)."""
    p = f"tinyserve_rotary{k}"
    scaled = [helper.make_node("Mul", [f"{p}_{t}_raw", scale], [f"{p}_{t}_half"])
              for t, scale in (("cos", cos_scale), ("sin", sin_scale)) if scale]
    graph.initializer.extend([numpy_helper.from_array(np.array([-1, d // 2], np.int64), f"{p}_cache_shape"),
                              numpy_helper.from_array(np.array(0, np.int64), f"{p}_zero"),
                              numpy_helper.from_array(np.array(1, np.int64), f"{p}_one")])
    return [helper.make_node("Shape", [f], [f"{p}_bs"], end=2),
            helper.make_node("ReduceProd", [f"{p}_bs"], [f"{p}_n"], keepdims=0),
            helper.make_node("Range", [f"{p}_zero", f"{p}_n", f"{p}_one"], [f"{p}_range"]),
            helper.make_node("Cos", [f], [f"{p}_cos_raw" if cos_scale else f"{p}_cos_half"]),
            helper.make_node("Sin", [f], [f"{p}_sin_raw" if sin_scale else f"{p}_sin_half"]),
            *scaled,
            helper.make_node("Reshape", [f"{p}_cos_half", f"{p}_cache_shape"], [f"{p}_cos_cache"]),
            helper.make_node("Reshape", [f"{p}_sin_half", f"{p}_cache_shape"], [f"{p}_sin_cache"]),
            helper.make_node("Reshape", [f"{p}_range", f"{p}_bs"], [f"{p}_rows"])]
