"""Build ``QueryAwareSparseAttention`` nodes and attach their function bodies.

The exporter, tests and benchmarks all emit the op through here, so a node
always carries the schema's attributes, the TensorRT plugin attributes and
the overload of the function body that implements it.
"""

from __future__ import annotations

from dataclasses import replace

import onnx
from onnx import TensorProto, helper

from . import schema
from .function import make_function

_NP_TO_ONNX = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int32": TensorProto.INT32,
               "int8": TensorProto.INT8, "uint8": TensorProto.UINT8, "bool": TensorProto.BOOL}


def make_node(inputs: list[str], outputs: list[str], attrs: schema.OpAttributes | None = None,
              name: str | None = None, cold_pages: bool = False, cold_format: str = "int8") -> onnx.NodeProto:
    """One op node. ``inputs``/``outputs`` follow ``schema.INPUTS``/``OUTPUTS`` order
    (``schema.node_input_names``); trailing optional ones may be omitted, and "" skips an
    optional one. Two-level attributes (``sub_page_size`` > 0) need ``key_sub_bounds``."""
    attrs = attrs or schema.OpAttributes()
    if len(inputs) < schema.NUM_REQUIRED_INPUTS or len(inputs) > len(schema.INPUTS):
        raise ValueError(f"{schema.OP_TYPE} takes {schema.NUM_REQUIRED_INPUTS}-{len(schema.INPUTS)} inputs, "
                         f"got {len(inputs)}")
    if not 1 <= len(outputs) <= len(schema.OUTPUTS):
        raise ValueError(f"{schema.OP_TYPE} has 1-{len(schema.OUTPUTS)} outputs, got {len(outputs)}")
    cold_given = inputs[schema.NUM_REQUIRED_INPUTS:schema.NUM_TIERED_INPUTS]
    n_cold = sum(1 for name in cold_given if name)
    if cold_pages and n_cold != len(schema.COLD_INPUTS):
        raise ValueError(f"cold_pages needs all of {schema.COLD_INPUTS}, got {list(cold_given)}")
    if n_cold and not cold_pages:
        raise ValueError("cold-page inputs given to a node without cold_pages=True (the plain overload ignores them)")
    has_fine = any(inputs[schema.NUM_TIERED_INPUTS:])
    if attrs.two_level != has_fine:
        raise ValueError(f"sub_page_size={attrs.sub_page_size} {'needs' if attrs.two_level else 'takes no'} "
                         f"{schema.TWO_LEVEL_INPUTS[0]!r} input (two-level selection reads it)")
    if len(outputs) < len(schema.OUTPUTS):
        # ORT inlines a function only when the node names every output; unused ones are just dropped.
        outputs = list(outputs) + [f"{outputs[0]}_{o}" for o in schema.OUTPUT_NAMES[len(outputs):]]
    if cold_pages:  # the node's cold_format attribute (what the TensorRT plugin reads) names its overload's
        attrs = replace(attrs, cold_format=cold_format)
    node = helper.make_node(schema.OP_TYPE, inputs, outputs, name=name, domain=schema.DOMAIN,
                            overload=attrs.function_overload(cold_pages, cold_format), **attrs.as_dict(),
                            **schema.PLUGIN_ATTRIBUTES)
    return node


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add the function body for every op overload the graph uses (idempotent) and the opset import."""
    have = {(f.domain, f.name, f.overload) for f in model.functions}
    for node in model.graph.node:
        if node.domain != schema.DOMAIN or node.op_type != schema.OP_TYPE:
            continue
        if (node.domain, node.op_type, node.overload) in have:
            continue
        attrs = node_attributes(node)
        cold = schema.overload_cold_format(node.overload)
        model.functions.append(make_function(attrs, cold_pages=cold is not None, opset=onnx_opset(model),
                                             cold_format=cold or "int8"))
        have.add((node.domain, node.op_type, node.overload))
    if not any(o.domain == schema.DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(schema.DOMAIN, schema.VERSION))
    if model.ir_version < 10:  # function overloads need IR 10
        model.ir_version = 10
    return model


def onnx_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), schema.OPSET)


def node_attributes(node: onnx.NodeProto) -> schema.OpAttributes:
    """The validated schema attributes of an op node (plugin attributes are ignored)."""
    known = {a.name for a in schema.ATTRIBUTES}
    values = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name in known}
    values = {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}
    return schema.OpAttributes(**values)


def make_op_model(dtype: str = "float32", attrs: schema.OpAttributes | None = None, head_dim: int | None = None,
                  with_selected: bool = True, cold_pages: bool = False, cold_format: str = "int8",
                  opset: int = schema.OPSET) -> onnx.ModelProto:
    """A model holding one op node, every input a graph input (tests, benchmarks).

    ``cold_pages``: the node also takes the cold-page inputs of ``cold_format`` (the
    ``_int8`` / ``_int4`` overload; int4 pools are uint8 ``[.., D/2]``, scales float16);
    two-level ``attrs`` add ``key_sub_bounds``. Feed it ``schema.node_input_names(...)``."""
    if dtype not in schema.FLOAT_TYPES:
        raise ValueError(f"dtype must be one of {schema.FLOAT_TYPES}, got {dtype!r}")
    attrs = attrs or schema.OpAttributes()
    names = schema.node_input_names(cold_pages, attrs.two_level)
    by_name = {s.name: s for s in schema.INPUTS}
    required = [by_name[n] for n in names if n]
    outputs = schema.OUTPUTS if with_selected else schema.OUTPUTS[:1]

    cold_types = dict(zip(schema.COLD_INPUTS, schema.COLD_DTYPES[cold_format]))

    def vi(spec):
        t = _NP_TO_ONNX[dtype if spec.dtype == "T" else cold_types.get(spec.name, spec.dtype)]
        shape = [head_dim if (d == "D" and head_dim) else d for d in spec.shape]
        if spec.name in schema.COLD_INPUTS and cold_format != "int8":
            shape = [*shape[:3], None]  # packed values [.., D/2], scales [.., C]
        return helper.make_tensor_value_info(spec.name, t, shape)

    node = make_node(list(names), [s.name for s in outputs], attrs, name="qsa", cold_pages=cold_pages,
                     cold_format=cold_format)
    graph = helper.make_graph([node], "query_aware_sparse_attention", [vi(s) for s in required],
                              [vi(s) for s in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return attach_functions(model)

