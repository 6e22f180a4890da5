"""A tiny builder of ONNX node lists, used to write function bodies readably.

``b.op("MatMul", x, y)`` appends a node and returns its output name, so a body
reads like the math it computes. It builds protos only; it runs nothing.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


class GraphBuilder:
    def __init__(self, prefix: str = "t", opset: int = 21):
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self._prefix = prefix
        self._count = 0

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{self._prefix}{self._count}_{hint}"

    def op(self, op_type: str, *inputs: str, _name: str | None = None, **attrs) -> str:
        """Append ``op_type(*inputs, **attrs)`` with one output; return its name."""
        return self.op_multi(op_type, inputs, 1, _name=_name, **attrs)[0]

    def op_multi(self, op_type: str, inputs, n_out: int, _name: str | None = None, **attrs) -> list[str]:
        outs = [_name if (_name and n_out == 1) else self._name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, **attrs))
        return outs

    def const(self, value, dtype=None, hint: str = "c") -> str:
        """A Constant node holding ``value`` (numpy-convertible)."""
        arr = np.asarray(value, dtype=dtype)
        out = self._name(hint)
        self.nodes.append(helper.make_node("Constant", [], [out], value=numpy_helper.from_array(arr, out)))
        return out

    def attr_const(self, attr_name: str, attr_type: str) -> str:
        """A Constant whose value is the calling node's attribute ``attr_name`` (a scalar)."""
        out = self._name(attr_name)
        key = {"int": "value_int", "float": "value_float"}[attr_type]
        node = helper.make_node("Constant", [], [out])
        a = onnx.AttributeProto()
        a.name = key
        a.ref_attr_name = attr_name
        a.type = onnx.AttributeProto.INT if attr_type == "int" else onnx.AttributeProto.FLOAT
        node.attribute.append(a)
        self.nodes.append(node)
        return out

    def dim(self, x: str, index: int, end: int | None = None) -> str:
        """Dims ``index`` (to ``end``) of tensor ``x`` as an int64 tensor (``[1]`` for one dim):
        one ``Shape(start, end)`` node (opset >= 15), which an exporter can resolve to a
        constant or to a graph input's dim (``export/shared_shapes.py``)."""
        return self.op("Shape", x, start=index, end=index + 1 if end is None else end)

    def cat(self, *parts: str) -> str:
        """Concat 1-D int64 pieces (shape building)."""
        return self.op("Concat", *parts, axis=0)

    def unsqueeze(self, x: str, axes) -> str:
        return self.op("Unsqueeze", x, self.const(list(axes), np.int64, "ax"))

    def reduce(self, op_type: str, x: str, axes, keepdims: int = 0) -> str:
        """ReduceMax/ReduceSum over ``axes``: axes are an input from opset 18 (13 for
        ReduceSum) and an attribute before, so one body serves every opset."""
        since = 13 if op_type == "ReduceSum" else 18
        if self.opset >= since:
            return self.op(op_type, x, self.const(list(axes), np.int64, "ax"), keepdims=keepdims)
        return self.op(op_type, x, axes=list(axes), keepdims=keepdims)

    def scalar(self, x: str) -> str:
        """[1] -> [] (Range and TopK-free scalars)."""
        return self.op("Squeeze", x, self.const([0], np.int64, "ax"))
