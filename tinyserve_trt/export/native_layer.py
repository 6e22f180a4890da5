"""Each native op node with its layer's head split, rotary and transposes as one native layer node.

After the fusions (``rotary.py``) an exported attention layer around a native node
(``native_switch.py``) reads, per layer::

    rows_q, rows_k, rows_v                         # [B, S, heads * D]: the projections (+ bias)
    x_t = Transpose(Reshape(rows_x, [B, S, heads, D]), perm=[0, 2, 1, 3])      # q, k, v
    q, new_key = RotaryEmbedding(q_t | k_t, positions, cos_cache, sin_cache)  # LLaMA family
    out, sel = QueryAwareSparseAttentionDecode(q, new_key, v_t, pools ...)    # new_value = v_t
    attn = Reshape(Transpose([Reshape](out), perm=[0, 2, 1, 3]), [B, S, H * D])

twelve nodes whose cost per node, not their work, is most of a short decode step's overhead (SmolLM2 at
512: 5 of its 38 profiled ms, ``benchmarks/results/decode_profile.md``). :class:`FuseNativeLayer`
(an onnx-ir pass of ``ort_passes.py``, after the rotary fusion) replaces them by one
``tinyserve.cpu::QueryAwareSparseAttentionLayer`` (``cpu/csrc/qsa_layer_cpu.cpp``) reading the rows,
the rotary tables and the op's pools, and writing ``attn`` and the values ``new_key`` / ``new_value``
/ ``selected_pages`` had (graph outputs: the runtime writes the pages from them). It matches by
structure and inferred shapes (no tensor names): both Transposes swap axes 1 and 2 of rank-4 values
whose last two dims are (heads, D) with D the pools' head dim; the rotary, when there is one, is
non-interleaved over the whole head dim with the same tables on q and k; the output chain's
Reshape before the Transpose, if any, keeps the shape. Anything else leaves the layer as it was.
The exporter validates the graph against the source either way. Reads no weights.
"""

from __future__ import annotations

import onnx_ir as ir

from .ir_graph import CountingRewrite, attr, dims, node_of, small_array

PERM = [0, 2, 1, 3]


class FuseNativeLayer(CountingRewrite):
    """Rewrite every matched layer of the main graph in place (see the module doc); the nodes left
    without readers go to RemoveUnusedNodesPass. ``count``: the last call's layers."""

    def rewrite(self, model: ir.Model) -> int:
        from ..cpu.native import DOMAIN, OP_TYPE

        done = 0
        for node in list(model.graph):
            if (node.domain, node.op_type) == (DOMAIN, OP_TYPE) and _fuse(model.graph, node):
                done += 1
        return done


def _target(reshape: ir.Node) -> list | None:
    """A Reshape's target shape, entry by entry: an int where it is a constant, None where it is
    computed (a Concat of one-element pieces, as exporters build them from Shape); None when the
    target is neither."""
    whole = small_array(reshape.inputs[1], max_size=8)
    if whole is not None:
        return [int(x) for x in whole.reshape(-1)]
    concat = node_of(reshape.inputs[1], "Concat")
    if concat is None or attr(concat, "axis") not in (0, -1):
        return None
    out = []
    for piece in concat.inputs:
        d = dims(piece)
        if d is not None and d != [1]:
            return None
        out.append(_constant(piece))
    return out


def _constant(value: ir.Value, depth: int = 4) -> int | None:
    """The int a one-element value holds when it is a constant, seen through Identity / Squeeze /
    Unsqueeze (the shared shapes' constants reach a Concat that way); None otherwise."""
    const = small_array(value, max_size=1)
    if const is not None:
        return int(const.reshape(-1)[0])
    node = value.producer()
    if depth == 0 or node is None or node.domain not in ("", "ai.onnx") or \
            node.op_type not in ("Identity", "Squeeze", "Unsqueeze"):
        return None
    return _constant(node.inputs[0], depth - 1)


def _rows(value: ir.Value, heads: int, head_dim: int) -> ir.Value | None:
    """rows [B, S, heads * D] when ``value`` [B, heads, S, D] = Transpose(Reshape(rows, [B, S, heads | -1,
    D]), PERM)."""
    t = node_of(value, "Transpose")
    if t is None or list(attr(t, "perm") or []) != PERM:
        return None
    r = node_of(t.inputs[0], "Reshape")
    target = None if r is None else _target(r)
    if target is None or len(target) != 4 or target[3] != head_dim or target[2] not in (heads, -1, None):
        return None
    rows = dims(r.inputs[0])
    if not rows or len(rows) != 3 or rows[2] != heads * head_dim:
        return None
    return r.inputs[0]


def _rotary(value: ir.Value, head_dim: int) -> tuple[ir.Value, tuple] | None:
    """(its input, (positions, cos_cache, sin_cache)) when ``value`` is a RotaryEmbedding the layer
    node computes alike: non-interleaved, over the whole head dim."""
    from .rotary import MS_DOMAIN

    r = value.producer()
    if r is None or (r.domain, r.op_type) != (MS_DOMAIN, "RotaryEmbedding") or len(r.inputs) != 4:
        return None
    if attr(r, "interleaved", 0) or attr(r, "rotary_embedding_dim", 0) not in (0, head_dim) or attr(r, "scale", 1.0) != 1.0:
        return None
    return r.inputs[0], tuple(r.inputs[1:])


def _output_chain(value: ir.Value, heads: int, head_dim: int) -> ir.Value | None:
    """The [B, S, heads * D] value the op's output [B, heads, S, D] becomes through
    [Reshape to [*, heads | -1, *, D]] -> Transpose(PERM) -> Reshape to [*, *, heads * D | -1], each
    the only reader of the one before."""
    def only_reader(v: ir.Value) -> ir.Node | None:
        uses = list(v.uses())
        return uses[0].node if len(uses) == 1 and not v.is_graph_output() else None

    node = only_reader(value)
    if node is not None and node.op_type == "Reshape":
        target = _target(node)
        if target is None or len(target) != 4 or target[3] != head_dim or target[1] not in (heads, -1):
            return None
        node = only_reader(node.outputs[0])
    if node is None or node.op_type != "Transpose" or list(attr(node, "perm") or []) != PERM:
        return None
    last = only_reader(node.outputs[0])
    if last is None or last.op_type != "Reshape" or last.inputs[0] is not node.outputs[0]:
        return None
    target = _target(last)
    if target is None or len(target) != 3 or target[2] not in (heads * head_dim, -1):
        return None
    return last.outputs[0]


def _fuse(graph: ir.Graph, native: ir.Node) -> bool:
    from ..cpu.native import LAYER_OP_TYPE

    q, k, v = native.inputs[:3]
    head_dim = (dims(native.inputs[3]) or [None])[-1]  # key_cache [P, Hkv, ps, D]
    if not isinstance(head_dim, int) or head_dim % 2:
        return False
    rot_q, rot_k = _rotary(q, head_dim), _rotary(k, head_dim)
    if (rot_q is None) != (rot_k is None) or (rot_q and any(a is not b for a, b in zip(rot_q[1], rot_k[1]))):
        return False
    q_t, k_t = (rot_q[0], rot_k[0]) if rot_q else (q, k)
    heads, kv_heads = (dims(q) or [None] * 4)[1], (dims(v) or [None] * 4)[1]  # the op's [B, H | Hkv, S, D]
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        return False
    rows = [_rows(x, h, head_dim) for x, h in ((q_t, heads), (k_t, kv_heads), (v, kv_heads))]
    if None in rows:
        return False
    rows_q, rows_k, rows_v = rows
    attn = _output_chain(native.outputs[0], heads, head_dim)
    if attn is None:
        return False
    tables = list(rot_q[1]) if rot_q else [None, None, None]
    inputs = [rows_q, rows_k, rows_v, *tables, *native.inputs[3:]]
    layer = ir.Node(native.domain, LAYER_OP_TYPE, inputs, [ir.Attr(a.name, a.type, a.value)
                                                           for a in native.attributes.values()],
                    name=f"{native.name}_layer", num_outputs=4)
    graph.insert_before(native, layer)
    selected = native.outputs[1] if len(native.outputs) > 1 else None
    for mine, old in zip(layer.outputs, (attn, selected, k, v)):
        if old is None:
            continue
        name, typ, shape = old.name, old.type, old.shape
        ir.convenience.replace_all_uses_with(old, mine, replace_graph_outputs=True)
        old.name = None
        mine.name, mine.type, mine.shape = name, typ, shape
    for i in range(len(native.inputs)):  # no reads of its own left: what only fed it goes unused
        native.replace_input_with(i, None)
    graph.remove(native, safe=False)  # its readers read the layer's outputs now
    return True
