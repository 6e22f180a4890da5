"""The op on its native CPU kernel in the ORT graph: which nodes it takes, and what a package says of it.

On ONNX Runtime's CPU EP the op otherwise runs as its inlined ONNX function: ~80-110
small nodes per layer (scores, TopK, gathers, masks) whose per-node cost, not the
cache reads, sets the decode step (``benchmarks/results/decode_profile.md#decode_profile_two_level``).
``tinyserve_trt.cpu`` builds the same op's decode step as one C++ node
(``tinyserve.cpu::QueryAwareSparseAttentionDecode``, an ORT custom op checked against
the numpy reference). In ``model.ort.onnx`` (``ort_graph.prepared_graph(native=True)``)
every op node the kernel implements (``NATIVE_POLICIES``, float32 hot pools, INT8 or INT4 cold pages:
:func:`ineligible`) becomes that node before inlining (``native_switch.py``): decode steps run its
selection, prefill chunks its causal attention (node version 3; version 2 packages switched each
layer on ``If(S == 1)`` with the inlined function for prefill, and still load). ``model.onnx`` and its
TensorRT plugin node are untouched. The graph then needs
the custom-op library in every session that loads it (:func:`session_options`;
``OrtGraphPlan.native_domain``: the runtime loads ``model.onnx`` when it cannot build it).
Does not read external data.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

from ..cpu.native import DOMAIN as NATIVE_DOMAIN
from ..cpu.native import OP_TYPE as NATIVE_OP
from ..cpu.node import POLICIES as NATIVE_POLICIES
from ..ops import schema

NATIVE_FLOAT_TYPES = (TensorProto.FLOAT,)


def is_op(node: onnx.NodeProto) -> bool:
    return node.domain == schema.DOMAIN and node.op_type == schema.OP_TYPE


def ineligible(node: onnx.NodeProto, elem_types: dict[str, int]) -> str | None:
    """Why ``node`` keeps its function for decode too (None: the native kernel takes it)."""
    from ..ops.node import node_attributes

    attrs = node_attributes(node)
    if attrs.policy not in NATIVE_POLICIES:
        return f"policy {attrs.policy!r} (native: {NATIVE_POLICIES})"
    cold = node.input[schema.NUM_REQUIRED_INPUTS:schema.NUM_TIERED_INPUTS]
    if any(cold) and not all(cold):
        return "some cold-page inputs missing"
    elem = elem_types.get(node.input[schema.INPUT_NAMES.index("key_cache")])
    if elem not in NATIVE_FLOAT_TYPES:
        return f"cache element type {elem} (native: float32)"
    return None


def unsupported(model: onnx.ModelProto) -> str | None:
    """Why no layer of ``model`` can decode on the native kernel (None: at least one can)."""
    elem_types = {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.input}
    reasons = [ineligible(n, elem_types) for n in model.graph.node if is_op(n)]
    if not reasons:
        return f"no {schema.OP_TYPE} node"
    return None if None in reasons else reasons[0]


def not_native_note(native: bool, unavailable: str | None, model: onnx.ModelProto | None = None) -> str:
    """Why an unvalidated ``model.ort.onnx`` decodes on the op's function (``OrtGraphPlan.native_why``,
    read by the runtime's kernel report and the export's summary; a validated one's says it
    itself, ``ort_validation.py``). ``native``: the export asked for the kernel
    (``ExportConfig.native_decode``); ``unavailable``: why the kernel could not be built; ``model``:
    the portable model, to name why no layer of it can use the kernel."""
    if not native:
        return "package exported with --no-native-decode"
    if unavailable:
        return f"the native kernel was unavailable at export ({unavailable})"
    reason = unsupported(model) if model is not None else None
    return "no layer of the model can decode on the native kernel" + (f" ({reason})" if reason else "")


def decode_summary(record) -> str | None:
    """The export summary's line on what decodes ``model.ort.onnx``'s steps: the native kernel or
    the op's function, and why the function (``record``: the manifest's ``OrtOptimized``; None:
    no ORT graph, a trt package)."""
    if record is None:
        return None
    if record.native:
        if (record.plan.native_version or 0) >= 3:  # node version 3 runs prefill chunks too
            return f"native CPU kernel ({record.native}), decode steps and prefill chunks"
        return f"native CPU kernel ({record.native}); prefill: the op's ONNX function"
    return f"the op's ONNX function ({record.native_note})" if record.native_note else "the op's ONNX function"


def native_calls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Copies of the op nodes of ``model``'s main graph the native kernel implements (those
    ``native_switch.ReplaceNativeCalls`` replaces)."""
    elem_types = {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.input}
    calls = []
    for node in model.graph.node:
        if is_op(node) and ineligible(node, elem_types) is None:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            calls.append(copy)
    return calls


def uses_native(model: onnx.ModelProto) -> bool:
    """The graph has nodes of the native CPU kernel's domain (sessions need the library). Its
    nodes, not its opset imports: ORT writes an import for every domain registered in the session."""
    def any_in(graph: onnx.GraphProto) -> bool:
        return any(n.domain == NATIVE_DOMAIN or any(any_in(a.g) for a in n.attribute
                                                    if a.type == onnx.AttributeProto.GRAPH) for n in graph.node)
    return any_in(model.graph)


def session_options(model: onnx.ModelProto | None = None):
    """Quiet ``ort.SessionOptions`` with the native CPU kernel's library registered when ``model``
    uses it (``tinyserve_trt.cpu.native``: NativeUnavailable names why it cannot)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if model is not None and uses_native(model):
        from ..cpu import native as cpu_native

        cpu_native.register(so)
    return so
