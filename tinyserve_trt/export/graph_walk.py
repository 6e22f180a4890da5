"""Structural helpers over an onnx_ir graph: producers, layout chains, constants.

Matching is on structure (op types, graph inputs/outputs, constants), never
on tensor names, so the same rule serves every exporter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

# Ops that only move or replicate data (the GQA repeat, the K transpose, views).
LAYOUT_OPS = frozenset({"Reshape", "Transpose", "Expand", "Unsqueeze", "Squeeze", "Identity", "Flatten"})


def consumers(value: ir.Value) -> list[ir.Node]:
    return [u.node for u in value.uses()]


def scalar_constant(value: ir.Value | None) -> float | None:
    """The value as a Python float if it is a constant holding one element."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        return None
    arr = tensor.numpy()
    return float(arr.reshape(-1)[0]) if arr.size == 1 else None


def is_past_input(value: ir.Value, graph: ir.Graph) -> ir.Value | None:
    """If ``value`` is a graph input, possibly behind exporter no-ops (Identity, a
    one-input Concat), return that graph input."""
    while True:
        if value.is_graph_input():
            return value
        node = value.producer()
        if node is None:
            return None
        real = [i for i in node.inputs if i is not None]
        if node.op_type in ("Identity",) or (node.op_type == "Concat" and len(real) == 1):
            value = real[0]
            continue
        return None


@dataclass
class CacheConcat:
    """``present = Concat(past, new, axis=-2)`` of one K or V cache."""

    node: ir.Node
    past_input: ir.Value  # the graph input [B, Hkv, P, D]
    new: ir.Value  # this step's keys/values [B, Hkv, S, D]
    present: ir.Value  # the Concat output (a graph output)


def as_cache_concat(value: ir.Value, graph: ir.Graph) -> CacheConcat | None:
    node = value.producer()
    if node is None or node.op_type != "Concat" or len(node.inputs) != 2:
        return None
    axis = node.attributes.get_int("axis", 0)
    if axis not in (-2, 2):
        return None
    past = is_past_input(node.inputs[0], graph)
    if past is None:
        return None
    return CacheConcat(node, past, node.inputs[1], value)


@dataclass
class Chain:
    """A walk up through layout ops and scalar multipliers to a source value."""

    source: ir.Value
    nodes: list[ir.Node] = field(default_factory=list)
    factors: list[tuple[ir.Node, ir.Value, bool]] = field(default_factory=list)  # (node, scalar, divides)


# A Cast that loses nothing: half -> float (torch's SDPA in fp16 up-casts V), or a no-op.
_WIDER = {ir.DataType.FLOAT16: (ir.DataType.FLOAT, ir.DataType.DOUBLE),
          ir.DataType.BFLOAT16: (ir.DataType.FLOAT, ir.DataType.DOUBLE),
          ir.DataType.FLOAT: (ir.DataType.DOUBLE,)}


# ops whose output has the element type of their data inputs (these positions)
_SAME_TYPE_AS = {**{op: (0,) for op in LAYOUT_OPS}, "Concat": (0, 1), "MatMul": (0, 1), "Softmax": (0,),
                 "Add": (0, 1), "Mul": (0, 1), "Div": (0, 1), "Sub": (0, 1), "Where": (1, 2)}


def value_dtype(value: ir.Value, depth: int = 0) -> ir.DataType | None:
    """``value``'s element type, read through Casts, Constants and type-preserving ops when shape
    inference left it unset (torch's legacy exports state few intermediate types)."""
    if value.dtype is not None:
        return value.dtype
    node = value.producer()
    if node is None or depth > 64:
        return None
    if node.op_type == "Cast":
        return ir.DataType(node.attributes.get_int("to", 0))
    const = ir.convenience.get_const_tensor(value)
    if const is not None:
        return const.dtype
    for i in _SAME_TYPE_AS.get(node.op_type, ()):
        if i < len(node.inputs) and node.inputs[i] is not None:
            found = value_dtype(node.inputs[i], depth + 1)
            if found is not None:
                return found
    return None


def is_widening_cast(node: ir.Node) -> bool:
    """A ``Cast`` whose target holds every value of its input's type (known, or read through layout ops)."""
    if node.op_type != "Cast" or node.inputs[0] is None:
        return False
    src, to = value_dtype(node.inputs[0]), ir.DataType(node.attributes.get_int("to", 0))
    return src is not None and (to == src or to in _WIDER.get(src, ()))


def walk_up(value: ir.Value, stop, allow_scale: bool = True) -> tuple[Chain | None, ir.Node | None]:
    """Follow data inputs (input 0, or the non-scalar operand of Mul/Div) up
    through layout ops, widening Casts and scalar Mul/Div until ``stop(value)``
    is true.

    Returns ``(chain, None)`` on success or ``(None, blocking_node)`` where the
    walk met an op it may not cross.
    """
    chain = Chain(value)
    v = value
    for _ in range(64):
        if stop(v):
            chain.source = v
            return chain, None
        node = v.producer()
        if node is None:
            return None, None
        if node.op_type in LAYOUT_OPS or is_widening_cast(node):
            chain.nodes.append(node)
            v = node.inputs[0]
            continue
        if allow_scale and node.op_type in ("Mul", "Div"):
            a, b = node.inputs
            if is_scalar_like(b):
                chain.nodes.append(node)
                chain.factors.append((node, b, node.op_type == "Div"))
                v = a
                continue
            if node.op_type == "Mul" and is_scalar_like(a):
                chain.nodes.append(node)
                chain.factors.append((node, a, False))
                v = b
                continue
        return None, node
    return None, None


def is_scalar_like(value: ir.Value | None) -> bool:
    """A constant scalar, or a scalar computed from shapes only (e.g. optimum's
    1/sqrt(sqrt(head_dim)) built from Shape at run time)."""
    if value is None:
        return False
    if scalar_constant(value) is not None:
        return True
    return _shape_derived(value, depth=0)


_SHAPE_MATH = frozenset({"Shape", "Gather", "Cast", "Sqrt", "Div", "Mul", "Reciprocal", "Constant", "Slice",
                         "Squeeze", "Unsqueeze", "Pow", "Concat", "Reshape"})


def _shape_derived(value: ir.Value, depth: int) -> bool:
    if depth > 16:
        return False
    if ir.convenience.get_const_tensor(value) is not None:
        return True
    node = value.producer()
    if node is None or node.op_type not in _SHAPE_MATH:
        return False
    if node.op_type == "Shape":
        return True
    return all(i is None or _shape_derived(i, depth + 1) for i in node.inputs)


def ancestors(value: ir.Value, limit: int = 100_000, data_only: bool = False) -> set[ir.Node]:
    """Producer nodes ``value`` depends on. ``data_only`` does not cross Shape
    nodes: a mask built from a tensor's shape does not depend on its values."""
    seen: set[ir.Node] = set()
    stack = [value]
    while stack and len(seen) < limit:
        v = stack.pop()
        node = v.producer() if v is not None else None
        if node is None or node in seen:
            continue
        seen.add(node)
        if data_only and node.op_type == "Shape":
            continue
        stack.extend(i for i in node.inputs if i is not None)
    return seen


def as_numpy(value: ir.Value) -> np.ndarray | None:
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()
