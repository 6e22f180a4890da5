"""Turn matched attention blocks into op nodes with paged KV I/O.

Per layer ``i`` the source's ``past_key_values.{i}.*`` inputs and
``present.{i}.*`` outputs become: inputs ``key_cache.{i}``, ``value_cache.{i}``
``[num_pages, Hkv, page_size, D]`` and ``key_min.{i}``, ``key_max.{i}``
``[num_pages, Hkv, D]``; outputs ``new_key.{i}``, ``new_value.{i}``
``[B, Hkv, S, D]`` (post-rotary, for the runtime to write into pages) and
``selected_pages.{i}``. Shared inputs: ``page_table``, ``past_lens``,
``token_budget``. The old concats, GQA repeats and masks die and are removed.

With a cold tier (issue #6) each layer's node is the ``<policy>_int8`` overload
and also takes ``key_cache_int8.{i}``, ``value_cache_int8.{i}``
``[num_cold_pages, Hkv, page_size, D]`` int8 (int4: ``_int4``, uint8 ``[.., D/2]``) and
``key_scale.{i}``, ``value_scale.{i}`` ``[num_cold_pages, Hkv, ps|1, D|1]`` float32
(int4: float16 ``[.., C]``; ``ops.cold_codec``) (the shape of
the granularity); ``key_min``/``key_max`` then cover both tiers
(``[total_pages, Hkv, D]``). The format is per layer (issue #17): an INT4 package's
``int8_layers`` get INT8 cold inputs and the ``_int8`` overload, the others ``_int4``; both
function bodies end up in the model (``ops.node.attach_functions``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import onnx_ir as ir

from ..ops import schema
from ..ops.cold_codec import ColdCodec
from .errors import UnsupportedError
from .graph_walk import consumers, value_dtype
from .rules.base import AttentionMatch
from .graph_io import SourceIO

PAGE_TABLE, PAST_LENS, TOKEN_BUDGET, LOGITS_INDEX = "page_table", "past_lens", "token_budget", "logits_index"


@dataclass
class LayerPlan:
    match: AttentionMatch
    attrs: schema.OpAttributes
    num_heads: int
    num_kv_heads: int
    head_dim: int
    shape_donors: dict = field(default_factory=dict)  # cache-side value -> value of the same shape but seq


@dataclass
class PagedIO:
    """Names of the rewritten model's I/O (written into the manifest)."""

    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    layers: list = field(default_factory=list)


def _input(graph: ir.Graph, name: str, dtype: ir.DataType, dims) -> ir.Value:
    v = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(dims))
    graph.inputs.append(v)
    return v


def _named_output(graph: ir.Graph, anchor: ir.Node, value: ir.Value, name: str, dtype: ir.DataType,
                  hkv: int, head_dim: int) -> ir.Value:
    node = ir.node("Identity", [value], name=f"tinyserve_{name}")
    node.outputs[0].name = name
    node.outputs[0].type = ir.TensorType(dtype)
    node.outputs[0].shape = ir.Shape(["batch", hkv, "sequence_length", head_dim])
    graph.insert_after(anchor, node)
    return node.outputs[0]


def _cold_inputs(graph: ir.Graph, i: int, hkv: int, page_size: int, d: int, cold: ColdCodec) -> list[ir.Value]:
    """``key_cache_int8``, ``value_cache_int8``, ``key_scale``, ``value_scale`` of layer ``i``
    (``schema.COLD_INPUTS`` order) in ``cold``'s format (element types ``schema.COLD_DTYPES``)."""
    types = [ir.DataType.from_numpy(np.dtype(t)) for t in schema.COLD_DTYPES[cold.cold_format]]
    pools = [_input(graph, f"{n}.{i}", t, ["num_cold_pages", *cold.pool_shape(hkv, page_size, d)])
             for n, t in zip(schema.COLD_INPUTS[:2], types[:2])]
    scales = [_input(graph, f"{n}.{i}", t, ["num_cold_pages", *cold.scale_shape(w, hkv, page_size, d)])
              for n, t, w in zip(schema.COLD_INPUTS[2:], types[2:], "kv")]
    return pools + scales


def rewrite(model: ir.Model, plans: list[LayerPlan], io: SourceIO, page_size: int, dtype: ir.DataType,
            last_token_logits: bool = True, cold: ColdCodec | Sequence[ColdCodec] | None = None) -> PagedIO:
    """``cold``: the cold tier's codec (format, granularities), one for every layer or a list with
    one per layer (an INT4 package's ``int8_layers`` are INT8: that layer's cold inputs, overload
    and ``cold_format`` attribute are INT8's), None for hot pages only."""
    g = model.graph
    codecs = None if cold is None else [cold] * len(plans) if isinstance(cold, ColdCodec) else list(cold)
    if codecs is not None and len(codecs) != len(plans):
        raise ValueError(f"{len(codecs)} cold codecs for {len(plans)} attention layers")
    paged = PagedIO()
    page_table = _input(g, PAGE_TABLE, ir.DataType.INT32, ["batch", "max_pages"])
    past_lens = _input(g, PAST_LENS, ir.DataType.INT32, ["batch"])
    budget = _input(g, TOKEN_BUDGET, ir.DataType.INT32, ["batch"])
    paged.inputs.update(input_ids=io.input_ids.name, page_table=PAGE_TABLE, past_lens=PAST_LENS,
                        token_budget=TOKEN_BUDGET)
    if io.position_ids is not None:
        paged.inputs["position_ids"] = io.position_ids.name
    old_outputs = []
    for i, plan in enumerate(plans):
        m = plan.match
        hkv, d = plan.num_kv_heads, plan.head_dim
        cold = codecs[i] if codecs else None  # this layer's codec
        caches = [_input(g, f"{n}.{i}", dtype, ["num_pages", hkv, page_size, d]) for n in ("key_cache", "value_cache")]
        meta = [_input(g, f"{n}.{i}", dtype, ["total_pages" if cold else "num_pages", hkv, d])
                for n in ("key_min", "key_max")]
        cold_in = _cold_inputs(g, i, hkv, page_size, d, cold) if cold else []
        sub_in = []
        if plan.attrs.two_level:  # compact sub-page bounds, by page id like key_min (ops/fine_bounds.py)
            r = page_size // plan.attrs.sub_page_size
            sub_in = [_input(g, f"{schema.TWO_LEVEL_INPUTS[0]}.{i}", ir.DataType.UINT8,
                             ["total_pages" if cold else "num_pages", hkv, r, d])]
            cold_in = cold_in or [None] * len(schema.COLD_INPUTS)  # skipped optional inputs
        anchor = m.output.producer()
        act = m.key.past_input.dtype  # the model's activation dtype
        q, k_new, v_new = (_cast(g, anchor, x, dtype) if dtype != act else x
                           for x in (m.query, m.key.new, m.value.new))
        for x, heads in ((q, plan.num_heads), (k_new, hkv), (v_new, hkv)):
            _state_new_token_shape(x, io.input_ids, heads, d, dtype)
        # the cold_format attribute (what the TensorRT plugin reads) and the overload name the same format
        attrs = replace(plan.attrs, cold_format=cold.cold_format) if cold else plan.attrs
        op = ir.node(schema.OP_TYPE, [q, k_new, v_new, *caches, *meta, page_table, past_lens, budget, *cold_in,
                                      *sub_in],
                     attributes={**attrs.as_dict(), **schema.PLUGIN_ATTRIBUTES}, domain=schema.DOMAIN,
                     overload=attrs.function_overload(bool(cold)),
                     num_outputs=2,
                     name=f"tinyserve_attention_{i}")
        op.outputs[0].name = f"attention_output.{i}"
        g.insert_before(anchor, op)
        out = op.outputs[0]
        # the op returns the pages' dtype (fp32 math inside); the model gets what its attention returned:
        # fp32 around FP16 pages, or float from an fp16 model whose SDPA up-casts (torch's legacy export)
        want = value_dtype(m.output) or act
        if dtype != want:
            out = _cast(g, anchor, out, want, after=op)
        m.output.replace_all_uses_with(out)
        new_k = _named_output(g, op, k_new, f"new_key.{i}", dtype, hkv, d)
        new_v = _named_output(g, op, v_new, f"new_value.{i}", dtype, hkv, d)
        op.outputs[1].name = f"selected_pages.{i}"
        op.outputs[0].type = ir.TensorType(dtype)
        op.outputs[1].type = ir.TensorType(ir.DataType.BOOL)
        op.outputs[1].shape = ir.Shape(["batch", hkv, "max_pages"])
        for present, new in ((m.key.present, new_k), (m.value.present, new_v)):
            g.outputs[g.outputs.index(present)] = new
            old_outputs.append(present)
        g.outputs.append(op.outputs[1])
        paged.layers.append(dict(key_cache=caches[0].name, value_cache=caches[1].name, key_min=meta[0].name,
                                 key_max=meta[1].name, new_key=new_k.name, new_value=new_v.name,
                                 selected_pages=op.outputs[1].name, policy=plan.attrs.policy,
                                 **{role: v.name for role, v in zip(schema.COLD_INPUTS, cold_in) if v is not None},
                                 **{role: v.name for role, v in zip(schema.TWO_LEVEL_INPUTS, sub_in)}))
    _drop_past_inputs(model, plans, io)
    if last_token_logits and _gather_last_token(g, io):
        paged.inputs["logits_index"] = LOGITS_INDEX
    paged.outputs["logits"] = io.logits.name
    return paged


def _state_new_token_shape(x: ir.Value, input_ids: ir.Value, heads: int, head_dim: int, dtype: ir.DataType) -> None:
    """Give an op's query/key/value input its shape ``[B, heads, S, D]`` with ``B, S`` named
    as ``input_ids``' dims (the new tokens: the op's contract). Shape inference often
    loses them through the source's computed Reshapes; stated, every layer's ``S`` is
    visibly one value (``shared_shapes.py`` then reads it once per step)."""
    dims = input_ids.shape.dims if input_ids.shape is not None else ()
    if len(dims) == 2:
        x.shape = ir.Shape([dims[0], heads, dims[1], head_dim])
        if x.type is None:  # onnx_ir writes no shape without a type
            x.type = ir.TensorType(dtype)


def _cast(g: ir.Graph, anchor: ir.Node, x: ir.Value, dtype: ir.DataType, after: ir.Node | None = None) -> ir.Value:
    node = ir.node("Cast", [x], attributes={"to": dtype})
    node.outputs[0].type = ir.TensorType(dtype)
    if after is not None:
        g.insert_after(after, node)
    else:
        g.insert_before(anchor, node)
    return node.outputs[0]


def _drop_past_inputs(model: ir.Model, plans: list[LayerPlan], io: SourceIO) -> None:
    """Remove past_key_values inputs and the attention mask once nothing live uses them.

    Exporters read the batch size or head dims off a past or present tensor's
    Shape (dynamo, legacy SDPA). A present's Shape now reads the new tokens'
    K/V, a past's a [B, Hkv, 0, D] stand-in (the new K/V may themselves
    depend on it): both agree on every dim but the sequence one. A past
    length has no meaning in a ragged paged batch: if something still
    depended on it, validation fails."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    g = model.graph
    RemoveUnusedNodesPass()(model)
    stand_in = None
    for _ in range(8):  # a redirected Shape can free the value feeding it: repeat to a fixpoint
        changed = False
        for plan in plans:
            for v, donor in plan.shape_donors.items():
                users = consumers(v)
                if users and all(u.op_type == "Shape" for u in users):
                    v.replace_all_uses_with(donor)
                    changed = True
            for v in (plan.match.key.past_input, plan.match.value.past_input):
                users = consumers(v)
                if users and all(u.op_type == "Shape" for u in users):
                    stand_in = stand_in or _empty_past_like(g, v, io)
                    v.replace_all_uses_with(stand_in)
                    changed = True
        RemoveUnusedNodesPass()(model)
        if not changed:
            break
    pasts = [p.match.key.past_input for p in plans] + [p.match.value.past_input for p in plans]
    for v in pasts + ([io.attention_mask] if io.attention_mask is not None else []):
        users = consumers(v)
        if users:
            what = "attention_mask" if v is io.attention_mask else "a past_key_values input"
            raise UnsupportedError(f"{what} ({v.name}) is still used after the rewrite by node "
                                   f"{users[0].name} ({users[0].op_type}); the paged runtime cannot feed it")
        g.inputs.remove(v)


def _empty_past_like(g: ir.Graph, past: ir.Value, io: SourceIO) -> ir.Value:
    """A [B, Hkv, 0, D] zeros tensor, B read off input_ids."""
    hkv, d = past.shape.dims[1], past.shape.dims[3]
    batch = ir.node("Shape", [io.input_ids], attributes={"start": 0, "end": 1})
    rest = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([hkv, 0, d], np.int64))})
    shape = ir.node("Concat", [batch.outputs[0], rest.outputs[0]], attributes={"axis": 0})
    zeros = ir.node("ConstantOfShape", [shape.outputs[0]],
                    attributes={"value": ir.tensor(np.zeros(1, past.dtype.numpy()))})
    zeros.outputs[0].name = "tinyserve_empty_past"
    g.insert_before(next(iter(g)), [batch, rest, shape, zeros])
    return zeros.outputs[0]


def _gather_last_token(g: ir.Graph, io: SourceIO) -> bool:
    """Compute logits for one position per sequence (``logits_index [B]``) instead
    of all S: a chunked prefill needs only the last token's. Returns False (all
    positions kept) when the LM head is not a MatMul on [B, S, hidden]."""
    node = io.logits.producer()
    while node is not None and node.op_type in ("Add", "Cast", "Identity"):
        node = node.inputs[0].producer()
    if node is None or node.op_type != "MatMul":
        return False
    hidden, weight = node.inputs
    w = ir.convenience.get_const_tensor(weight) if weight.producer() is None else None
    if w is None and not weight.is_initializer():
        return False
    width = (weight.shape.dims[0] if weight.shape is not None else None)
    if not isinstance(width, int):
        return False
    index = _input(g, LOGITS_INDEX, ir.DataType.INT64, ["batch"])
    shape = ir.node("Shape", [hidden], attributes={"start": 0, "end": 1})
    tail = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([1, width], np.int64))})
    target = ir.node("Concat", [shape.outputs[0], tail.outputs[0]], attributes={"axis": 0})
    idx_shape = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([-1, 1, 1], np.int64))})
    idx3 = ir.node("Reshape", [index, idx_shape.outputs[0]])
    idx_full = ir.node("Expand", [idx3.outputs[0], target.outputs[0]])
    gathered = ir.node("GatherElements", [hidden, idx_full.outputs[0]], attributes={"axis": 1})
    g.insert_before(node, [shape, tail, target, idx_shape, idx3, idx_full, gathered])
    node.replace_input_with(0, gathered.outputs[0])
    return True
