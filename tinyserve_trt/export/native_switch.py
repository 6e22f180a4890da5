"""The ORT graph's decode switch as onnx-ir passes: each native-eligible layer becomes ``If(S == 1)``.

``native_decode.py`` says what and why: the op nodes the native CPU kernel implements
(:class:`CollectNativeCalls`, before inlining dissolves them) decode on one
``tinyserve.cpu`` node and prefill on the layer's own inlined body nodes
(:class:`SwitchDecodeSteps`, after inlining and the per-step merge)::

    If(Shape(query)[2] == 1)                       # one condition for all layers
      then: QueryAwareSparseAttentionDecode(the node's inputs and attributes)
      else: the layer's own inlined body nodes     # prefill: the function, as before

A layer's body is found by its inputs and outputs: the nodes downstream of its query /
key / value / pools and upstream of its outputs. Per-step values (page counts, masks:
``shared_shapes.py``, merged across layers) are upstream of no layer input and stay in
the main graph. An onnx-ir value is one object in every scope, so the body's nodes move
into the branch as they are and keep reading the main graph's values. Reads no weights.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from ..ops import schema
from .native_decode import NATIVE_DOMAIN, SWITCH_SUFFIX, ineligible, is_op

NOT_OWN = ("page_table", "past_lens", "token_budget")  # shared by the layers: per-step values read them


class CollectNativeCalls(ir.passes.InPlacePass):
    """Appends to ``calls`` a copy (an ``onnx.NodeProto``) of each op node of the main graph the
    native kernel implements. Does not modify the model."""

    def __init__(self, calls: list):
        super().__init__()
        self.calls = calls

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        elem_types = {v.name: int(v.dtype) for v in model.graph.inputs if v.dtype is not None}
        for node in model.graph:
            proto = ir.serde.serialize_node(node)
            if is_op(proto) and ineligible(proto, elem_types) is None:
                self.calls.append(proto)
        return ir.passes.PassResult(model, modified=False)


def _reads(node: ir.Node, graph: ir.Graph) -> set[ir.Value]:
    """Values of ``graph`` that ``node`` reads, its subgraphs' outer-scope reads included."""
    out = {v for v in node.inputs if v is not None}
    for g in _subgraphs(node):
        for n in g.all_nodes():
            out.update(v for v in n.inputs if v is not None and v.graph is graph)
        out.update(v for v in g.outputs if v.graph is graph)
    return out


class SwitchDecodeSteps(ir.passes.InPlacePass):
    """Rewrite the (inlined, per-step merged) model in place: each of ``calls``' body nodes move
    into the ``else`` branch of an ``If(S == 1)`` whose ``then`` branch is the native node (see the
    module doc). ``count``: the layers the last call switched. Raises ValueError when a body cannot
    be cut out (a value of it read outside), which would be a bug of the passes before."""

    count = 0

    def __init__(self, calls: list):
        super().__init__()
        self.calls = calls

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from ..cpu.node import VERSION

        graph = model.graph
        cond, reads = None, {}  # node -> what it reads, kept across layers for the nodes left as they were
        for call in self.calls:
            cond = _switch(graph, call, cond, reads)
        self.count = len(self.calls)
        if self.calls:
            model.graph.opset_imports.setdefault(NATIVE_DOMAIN, VERSION)
        return ir.passes.PassResult(model, modified=bool(self.calls))


def _switch(graph: ir.Graph, call: onnx.NodeProto, cond: ir.Value | None, reads: dict) -> ir.Value:
    """Switch one layer (``call``: its op node before inlining); returns the shared condition.
    ``reads``: :func:`_reads` of the main graph's nodes, kept up to date here."""
    from ..cpu.node import input_names, make_decode_node
    from ..ops.node import node_attributes

    nodes = list(graph)
    by_name = {v.name: v for v in [*graph.inputs, *graph.initializers.values()] + [o for n in nodes for o in n.outputs]
               if v.name}
    outputs = set(graph.outputs)
    outs = [by_name[o] for i, o in enumerate(call.output)
            if o and o in by_name and (i == 0 or by_name[o].uses() or by_name[o] in outputs)]
    for n in nodes:
        if n not in reads:
            reads[n] = _reads(n, graph)
    upstream, stack = set(), [v.producer() for v in outs if v.producer() is not None]
    while stack:
        n = stack.pop()
        if n in upstream:
            continue
        upstream.add(n)
        stack.extend(v.producer() for v in reads[n] if v.producer() is not None)
    own = {by_name[call.input[i]] for i, t in enumerate(schema.INPUTS)
           if i < len(call.input) and call.input[i] and t.name not in NOT_OWN and call.input[i] in by_name}
    body = []
    for n in nodes:
        if n in upstream and reads[n] & own:
            body.append(n)
            own.update(n.outputs)
    if not body:
        raise ValueError(f"{call.name}: no inlined body found for outputs {[v.name for v in outs]}")
    inside = set(body) | {m for n in body for g in _subgraphs(n) for m in g.all_nodes()}  # with their branches'
    made = {o for n in body for o in n.outputs}
    leaks = {v for n in nodes if n not in inside for v in reads[n] & made} - set(outs)
    leaks |= (outputs & made) - set(outs)
    if leaks:
        raise ValueError(f"{call.name}: body values {sorted(v.name for v in leaks)[:3]} are read outside it")
    tag = call.name or f"tinyserve_attention_{outs[0].name}"
    if cond is None:  # one switch for all layers: every layer's query has the step's S
        name = "tinyserve_native_is_decode"
        one = ir.Value(name=f"{name}_one", shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64),
                       const_value=ir.tensor([1], dtype=ir.DataType.INT64, name=f"{name}_one"))
        graph.register_initializer(one)
        shape = ir.node("Shape", [by_name[call.input[0]]], {"start": 2, "end": 3}, name=f"{name}_shape",
                        outputs=[ir.Value(name=f"{name}_s")])
        equal = ir.node("Equal", [shape.outputs[0], one], name=f"{name}_equal", outputs=[ir.Value(name=name)])
        graph.insert_before(body[0], [shape, equal])  # before the first switch's body began
        cond = equal.outputs[0]
    pool_type = ir.DataType(by_name[call.input[schema.INPUT_NAMES.index("key_cache")]].dtype)
    types = [pool_type, ir.DataType.BOOL][:len(outs)]
    attrs = node_attributes(call)
    value = dict(zip(schema.INPUT_NAMES, call.input))  # the op node's inputs are in schema order
    cold = any(value.get(n) for n in schema.COLD_INPUTS)
    proto = make_decode_node([value[n] if n else "" for n in input_names(attrs.two_level, cold)],
                             [f"{v.name}_native" for v in outs], attrs, name=f"{tag}_native", cold_pages=cold)
    native = ir.Node(proto.domain, proto.op_type, [by_name[i] if i else None for i in proto.input],
                     [ir.serde.deserialize_attribute(a) for a in proto.attribute], name=proto.name,
                     outputs=[ir.Value(name=o, type=ir.TensorType(t)) for o, t in zip(proto.output, types)])
    results = [ir.Value(name=v.name, type=v.type, shape=v.shape) for v in outs]  # the If's outputs
    branch_outs, moved = [], list(body)
    for v, result, t in zip(outs, results, types):
        readers = [(n, i) for n, i in v.uses() if n not in inside]
        name = v.name
        if v in made:
            v.name = f"{name}_function"
            branch_outs.append(v)
        else:  # made from per-step values alone (a dense layer's selected pages): passed through
            v.name = f"{name}_step"
            v.type, v.shape = None, None  # its value_info is the If output's now, as the name's was
            ident = ir.node("Identity", [v], outputs=[ir.Value(name=f"{name}_function", type=ir.TensorType(t))])
            moved.append(ident)
            branch_outs.append(ident.outputs[0])
        for n, i in readers:
            n.replace_input_with(i, result)
            if n.graph is graph:
                reads.pop(n, None)  # it reads the If's output now
            else:  # a reader inside another node's branch: which main node holds it is not kept
                reads.clear()
        for k, o in enumerate(graph.outputs):
            if o is v:
                graph.outputs[k] = result
        result.name = name
    for v, t in zip(branch_outs, types):
        v.type = ir.TensorType(t)
    after = nodes[nodes.index(body[-1]) + 1:]
    at = next((n for n in after if n not in inside), None)  # the If goes where the body ended
    graph.remove(body, safe=False)
    for n in body:
        reads.pop(n, None)
    then_g = ir.Graph([], list(native.outputs), nodes=[native], name=f"{tag}_decode")
    else_g = ir.Graph([], branch_outs, nodes=moved, name=f"{tag}_prefill")
    switch = ir.node("If", [cond], {"then_branch": then_g, "else_branch": else_g}, outputs=results,
                     name=f"{tag}{SWITCH_SUFFIX}")
    if at is None:
        graph.append(switch)
    else:
        graph.insert_before(at, switch)
    return cond


def _subgraphs(node: ir.Node) -> list[ir.Graph]:
    out = []
    for a in node.attributes.values():
        if a.type == ir.AttributeType.GRAPH:
            out.append(a.as_graph())
        elif a.type == ir.AttributeType.GRAPHS:
            out.extend(a.as_graphs())
    return out
