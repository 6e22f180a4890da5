"""Decode steps on the op's native CPU kernel: each layer switches on ``If(S == 1)``.

On ONNX Runtime's CPU EP the op otherwise runs as its inlined ONNX function: ~80-110
small nodes per layer (scores, TopK, gathers, masks) whose per-node cost, not the
cache reads, sets the decode step (``benchmarks/results/decode_profile.md#decode_profile_two_level``).
``tinyserve_trt.cpu`` builds the same op's decode step as one C++ node
(``tinyserve.cpu::QueryAwareSparseAttentionDecode``, an ORT custom op checked against
the numpy reference). In ``model.ort.onnx`` (``ort_graph.prepared_graph(native=True)``)
every op node the kernel implements (``NATIVE_POLICIES``, float32 hot pools, INT8 or INT4 cold pages:
:func:`native_calls`, taken before inlining) becomes, after inlining and the per-step
merge (:func:`switch_decode_steps`)::

    If(Shape(query)[2] == 1)                       # one condition for all layers
      then: QueryAwareSparseAttentionDecode(the node's inputs and attributes)
      else: the layer's own inlined body nodes     # prefill: the function, as before

The per-step bookkeeping (page counts, masks, the dense switch inputs) stays in the
main graph, merged across layers as without the kernel, so prefill runs what it ran
before. ``model.onnx`` and its TensorRT plugin node are untouched. The graph then needs
the custom-op library in every session that loads it (:func:`session_options`;
``OrtGraphPlan.native_domain``: the runtime loads ``model.onnx`` when it cannot build it).
Does not read external data.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ..cpu.native import DOMAIN as NATIVE_DOMAIN
from ..cpu.native import OP_TYPE as NATIVE_OP
from ..cpu.node import POLICIES as NATIVE_POLICIES
from ..ops import schema

NATIVE_FLOAT_TYPES = (TensorProto.FLOAT,)
SWITCH_SUFFIX = "_decode_switch"


def is_switch(node: onnx.NodeProto) -> bool:
    """An ``If`` this module made (then: the native kernel; else: the function)."""
    return node.op_type == "If" and node.name.endswith(SWITCH_SUFFIX)


def _is_op(node: onnx.NodeProto) -> bool:
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
    reasons = [ineligible(n, elem_types) for n in model.graph.node if _is_op(n)]
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
        return f"native CPU kernel ({record.native}); prefill: the op's ONNX function"
    return f"the op's ONNX function ({record.native_note})" if record.native_note else "the op's ONNX function"


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in node.attribute for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs))]


def _reads(node: onnx.NodeProto) -> set[str]:
    """Values ``node`` reads, its subgraphs' outer-scope reads included."""
    names = {i for i in node.input if i}
    for g in _subgraphs(node):
        inner = {i.name for i in g.input} | {t.name for t in g.initializer}
        for n in g.node:
            names |= _reads(n) - inner
            inner.update(n.output)
        names |= {o.name for o in g.output} - inner
    return names


def native_calls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Copies of the op nodes of ``model``'s main graph the native kernel implements (taken
    before inlining: :func:`switch_decode_steps` finds their bodies by their inputs and outputs)."""
    elem_types = {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.input}
    calls = []
    for node in model.graph.node:
        if _is_op(node) and ineligible(node, elem_types) is None:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            calls.append(copy)
    return calls


def _body(nodes: list[onnx.NodeProto], call: onnx.NodeProto, outs: list[str]) -> list[int]:
    """Indices of the nodes of ``call``'s inlined body that read the layer's own inputs: those
    downstream of its query/key/value/pools and upstream of its outputs. Per-step values (page
    counts, masks: ``shared_shapes.py``, merged across layers) are upstream of no layer input and
    stay outside."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    upstream, stack = set(), [producer[o] for o in outs]
    while stack:
        i = stack.pop()
        if i in upstream:
            continue
        upstream.add(i)
        stack.extend(producer[v] for v in _reads(nodes[i]) if v in producer)
    own = {call.input[i] for i, t in enumerate(schema.INPUTS)
           if i < len(call.input) and call.input[i] and t.name not in ("page_table", "past_lens", "token_budget")}
    body = []
    for i, n in enumerate(nodes):
        if i in upstream and _reads(n) & own:
            body.append(i)
            own.update(o for o in n.output if o)
    return body


def switch_decode_steps(model: onnx.ModelProto, calls: list[onnx.NodeProto]) -> int:
    """Rewrite ``model`` (inlined, per-step values shared) in place: each call's body nodes move
    into the ``else`` branch of an ``If(S == 1)`` whose ``then`` branch is the native node (see the
    module doc). Returns how many layers switch. Raises ValueError when a body cannot be cut out
    (a value of it read outside), which would be a bug of the passes before."""
    from ..cpu.node import VERSION, input_names, make_decode_node
    from ..ops.node import node_attributes

    graph = model.graph
    kinds = {vi.name: vi.type.tensor_type.elem_type for vi in graph.input}
    outside = {o.name for o in graph.output}
    cond = None
    for call in calls:
        nodes = list(graph.node)
        read_after = outside.copy()
        for n in nodes:
            read_after |= _reads(n)
        outs = [o for i, o in enumerate(call.output) if o and (i == 0 or o in read_after)]
        body = _body(nodes, call, outs)
        if not body:
            raise ValueError(f"{call.name}: no inlined body found for outputs {outs}")
        inside = set(body)
        made = {o for i in body for o in nodes[i].output if o}
        leaks = {v for j, n in enumerate(nodes) if j not in inside for v in _reads(n) & made} - set(outs)
        leaks |= (outside & made) - set(outs)
        if leaks:
            raise ValueError(f"{call.name}: body values {sorted(leaks)[:3]} are read outside it")
        tag = call.name or f"tinyserve_attention_{outs[0]}"
        new = []
        if cond is None:  # one switch for all layers: every layer's query has the step's S
            cond = "tinyserve_native_is_decode"
            new += [helper.make_node("Shape", [call.input[0]], [f"{cond}_s"], name=f"{cond}_shape", start=2, end=3),
                    helper.make_node("Equal", [f"{cond}_s", f"{cond}_one"], [cond], name=f"{cond}_equal")]
            graph.initializer.append(helper.make_tensor(f"{cond}_one", TensorProto.INT64, [1], [1]))
        pool_type = kinds[call.input[schema.INPUT_NAMES.index("key_cache")]]
        types = [pool_type, TensorProto.BOOL][:len(outs)]
        attrs = node_attributes(call)
        value = dict(zip(schema.INPUT_NAMES, call.input))  # the op node's inputs are in schema order
        cold = any(value.get(n) for n in schema.COLD_INPUTS)
        native = make_decode_node([value[n] if n else "" for n in input_names(attrs.two_level, cold)],
                                  [f"{o}_native" for o in outs], attrs, name=f"{tag}_native", cold_pages=cold)
        renamed = {o: f"{o}_function" for o in outs}
        body_nodes = [nodes[i] for i in body]
        for n in body_nodes:
            for k, o in enumerate(n.output):
                if o in renamed:
                    n.output[k] = renamed[o]
        for o in outs:  # made from per-step values alone (a dense layer's selected pages): passed through
            if o not in made:
                src = nodes[next(j for j, n in enumerate(nodes) if o in n.output)]
                src.output[list(src.output).index(o)] = f"{o}_step"
                body_nodes.append(helper.make_node("Identity", [f"{o}_step"], [renamed[o]]))
        switch = helper.make_node(
            "If", [cond], outs, name=f"{tag}{SWITCH_SUFFIX}",
            then_branch=helper.make_graph([native], f"{tag}_decode", [],
                                          [helper.make_tensor_value_info(f"{o}_native", t, None)
                                           for o, t in zip(outs, types)]),
            else_branch=helper.make_graph(body_nodes, f"{tag}_prefill", [],
                                          [helper.make_tensor_value_info(renamed[o], t, None)
                                           for o, t in zip(outs, types)]))
        first, last = body[0], body[-1]
        kept = [n for j, n in enumerate(nodes) if j not in inside]
        at = sum(1 for j in range(last) if j not in inside)  # the If goes where the body ended
        kept[at:at] = [switch]
        head = sum(1 for j in range(first) if j not in inside)
        kept[head:head] = new  # the shared condition before the first switch's body began
        del graph.node[:]
        graph.node.extend(kept)
    if calls and not any(o.domain == NATIVE_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(NATIVE_DOMAIN, VERSION))
    return len(calls)


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
