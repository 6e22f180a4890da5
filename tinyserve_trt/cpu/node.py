"""Build ``tinyserve.cpu::QueryAwareSparseAttentionDecode`` nodes: the op's decode step, native.

The node's inputs are the op's, at the op's positions (``schema.node_input_names``: the required
ones, then the four cold inputs - "" when a two-level node has no cold pages - then
``key_sub_bounds``); the C++ reads the positions from the generated ``plugins/generated/qsa_schema.h``. Its
attributes are the schema's (``schema.OpAttributes``), ``cold_format`` only with cold pages.
``VERSION`` 3: the node runs prefill chunks (S > 1) too, so an exporter replaces the op node by it
outright. Version 2 ran S == 1 only (its graphs put it in the decode branch of an ``If``, the
function body in the other); a version-3 library runs those graphs unchanged (``RUNS_VERSIONS``).
Version 1 put ``key_sub_bounds`` before the cold inputs (such a package fails at session creation
or its first decode step: re-export it).
It runs only in an ORT session whose options went through ``native.register``.
"""

from __future__ import annotations

from ..ops import policies, schema
from .native import DOMAIN, LAYER_OP_TYPE, OP_TYPE

VERSION = 3  # 3: every S; 2: the schema's input positions (1 had key_sub_bounds at 10, the cold tier after it)
RUNS_VERSIONS = (2, 3)  # graphs written for these node versions run on this library
POLICIES = policies.implemented_by("cpu")  # the selection policies the kernel implements (csrc refuses others)


def input_names(two_level: bool, cold_pages: bool = False) -> tuple[str, ...]:
    """The node's inputs: the op's own (``schema.node_input_names``), "" for a skipped one."""
    return schema.node_input_names(cold_pages=cold_pages, two_level=two_level)


def make_decode_node(inputs: list[str], outputs: list[str], attrs: schema.OpAttributes | None = None,
                     name: str | None = None, cold_pages: bool = False):
    """One native decode node; ``inputs`` as :func:`input_names`, ``outputs`` 1-2 of ``schema.OUTPUTS``."""
    from onnx import helper

    attrs = attrs or schema.OpAttributes()
    if attrs.policy not in POLICIES:
        raise ValueError(f"{OP_TYPE} does not implement policy {attrs.policy!r} (it implements {POLICIES})")
    want = len(input_names(attrs.two_level, cold_pages))
    if len(inputs) != want:
        raise ValueError(f"{OP_TYPE} with sub_page_size={attrs.sub_page_size}{' and cold pages' if cold_pages else ''} "
                         f"takes {want} inputs, got {len(inputs)}")
    if not 1 <= len(outputs) <= len(schema.OUTPUTS):
        raise ValueError(f"{OP_TYPE} has 1-{len(schema.OUTPUTS)} outputs, got {len(outputs)}")
    values = {k: v for k, v in attrs.as_dict().items() if cold_pages or k != "cold_format"}
    return helper.make_node(OP_TYPE, list(inputs), list(outputs), name=name, domain=DOMAIN, **values)


def make_decode_model(attrs: schema.OpAttributes | None = None, with_selected: bool = True,
                      opset: int = schema.OPSET, cold_pages: bool = False):
    """A float32 model holding one native decode node, every input a graph input (tests, benchmarks);
    ``cold_pages``: with the cold inputs in ``attrs.cold_format``'s types (``schema.COLD_DTYPES``)."""
    from onnx import TensorProto, helper

    attrs = attrs or schema.OpAttributes()
    types = {"float32": TensorProto.FLOAT, "T": TensorProto.FLOAT, "int32": TensorProto.INT32, "int8": TensorProto.INT8,
             "uint8": TensorProto.UINT8, "bool": TensorProto.BOOL, "float16": TensorProto.FLOAT16}
    by_name = {s.name: s for s in (*schema.INPUTS, *schema.OUTPUTS)}
    cold_types = dict(zip(schema.COLD_INPUTS, schema.COLD_DTYPES[attrs.cold_format]))
    names = input_names(attrs.two_level, cold_pages)
    outputs = schema.OUTPUT_NAMES if with_selected else schema.OUTPUT_NAMES[:1]

    def vi(name):
        spec = by_name[name]
        shape = None if name in cold_types else list(spec.shape)  # int4 pools are [.., D/2]
        return helper.make_tensor_value_info(name, types[cold_types.get(name, spec.dtype)], shape)

    node = make_decode_node(list(names), list(outputs), attrs, name="qsa_decode", cold_pages=cold_pages)
    graph = helper.make_graph([node], "query_aware_sparse_attention_decode", [vi(n) for n in names if n],
                              [vi(n) for n in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, VERSION)],
                             ir_version=10)


# tinyserve.cpu::QueryAwareSparseAttentionLayer (csrc/qsa_layer_cpu.cpp): the op plus the layer's
# work around it. Its inputs: the projections' rows and the rotary tables, then the op's own from
# key_cache on, at the schema's positions shifted by len(LAYER_PREFIX). Outputs: the attention
# output [B, S, H*D], selected_pages, new_key and new_value [B, Hkv, S, D] (the key rotated).
LAYER_PREFIX = ("query", "key", "value", "rotary_positions", "cos_cache", "sin_cache")
LAYER_OUTPUTS = ("output", "selected_pages", "new_key", "new_value")
_FIRST_POOL = schema.INPUT_NAMES.index("key_cache")


def layer_input_names(two_level: bool, cold_pages: bool = False, rotary: bool = True) -> tuple[str, ...]:
    """The layer node's inputs ("" for a skipped optional one): ``LAYER_PREFIX`` (without the
    rotary three when ``rotary`` is false), then :func:`input_names` from key_cache on."""
    prefix = LAYER_PREFIX if rotary else LAYER_PREFIX[:3] + ("", "", "")
    return prefix + input_names(two_level, cold_pages)[_FIRST_POOL:]


def make_layer_node(inputs: list[str], outputs: list[str], attrs: schema.OpAttributes | None = None,
                    name: str | None = None, cold_pages: bool = False):
    """One native layer node; ``inputs`` as :func:`layer_input_names`, ``outputs`` up to 4 of
    ``LAYER_OUTPUTS`` ("" for one the graph does not read)."""
    from onnx import helper

    attrs = attrs or schema.OpAttributes()
    if attrs.policy not in POLICIES:
        raise ValueError(f"{LAYER_OP_TYPE} does not implement policy {attrs.policy!r} (it implements {POLICIES})")
    want = len(layer_input_names(attrs.two_level, cold_pages))
    if len(inputs) != want:
        raise ValueError(f"{LAYER_OP_TYPE} with sub_page_size={attrs.sub_page_size}"
                         f"{' and cold pages' if cold_pages else ''} takes {want} inputs, got {len(inputs)}")
    if not 1 <= len(outputs) <= len(LAYER_OUTPUTS):
        raise ValueError(f"{LAYER_OP_TYPE} has 1-{len(LAYER_OUTPUTS)} outputs, got {len(outputs)}")
    values = {k: v for k, v in attrs.as_dict().items() if cold_pages or k != "cold_format"}
    return helper.make_node(LAYER_OP_TYPE, list(inputs), list(outputs), name=name, domain=DOMAIN, **values)
