"""Print the node chain of one attention block of a KV-cache ONNX export.

A reading aid for docs/export_patterns.md, found by structure only (never
by node names, which differ per exporter):

- the block's cache Concats are the producers of ``present.{layer}.key/value``;
- the *core* is everything downstream of those Concats up to (and including)
  the first MatMul/Gemm whose weight is a constant (o_proj / c_proj);
- the *inputs* of the core are walked back up to the first constant-weight
  MatMul/Gemm (q/k/v projections, included), a Shape/Size node, or a graph
  input. Shared prelude (rotary cos/sin, the 4-D mask) is therefore listed too.

Nodes print in graph (topological) order as ``op  [out dtype+shape]  <- inputs``
with the attributes that matter for rewriting (perm, axis, to, scale, ...).
Nodes computing only int64/bool values (shape arithmetic, masks) are tagged
``int`` so the float data path stands out; ``--float-only`` hides them.

Usage: ``python -m tinyserve_dev.models.graph_report MODEL.onnx [--layer 0]``
"""

from __future__ import annotations

import argparse
from pathlib import Path

_ATTRS = ("perm", "axis", "axes", "to", "scale", "is_causal", "q_num_heads", "kv_num_heads",
          "interleaved", "num_heads", "rotary_embedding_dim", "transA", "transB", "split",
          "value", "softmax_precision", "qk_matmul_output_mode", "keepdims", "starts", "ends")


def _load(path: Path):
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    try:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:  # shape info is a nicety here, not a requirement
        pass
    return model


def _types(model) -> dict[str, str]:
    import onnx

    out = {}
    for v in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output):
        t = v.type.tensor_type
        if not t.elem_type:
            continue
        dims = [d.dim_param or (str(d.dim_value) if d.HasField("dim_value") else "?") for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name
        out[v.name] = f"{dtype}[{','.join(dims)}]" if t.HasField("shape") else dtype
    return out


def attention_block(model, layer: int = 0) -> list:
    """Graph-ordered nodes of layer ``layer``'s attention (see module docstring)."""
    graph = model.graph
    consts = {i.name for i in graph.initializer}
    consts |= {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def is_weight_matmul(node) -> bool:
        if node.op_type not in ("MatMul", "Gemm"):
            return False
        return any(_const_like(i, consts, producer) for i in node.input[1:2])

    outputs = {o.name for o in graph.output}
    concats = [producer[f"present.{layer}.{kind}"] for kind in ("key", "value")
               if f"present.{layer}.{kind}" in outputs and f"present.{layer}.{kind}" in producer]
    if not concats:
        raise ValueError(f"no producer for present.{layer}.key/value in this graph")
    core, stack = set(), list(concats)
    while stack:
        node = stack.pop()
        if id(node) in core:
            continue
        core.add(id(node))
        if is_weight_matmul(node) and node not in concats:
            continue  # o_proj: stop
        if node.op_type in ("Shape", "Size"):
            continue  # legacy exports read later layers' lengths off present.*: not data flow
        for o in node.output:
            stack.extend(consumers.get(o, []))
    block, stack = set(core), [n for n in graph.node if id(n) in core]
    while stack:
        node = stack.pop()
        if is_weight_matmul(node) and id(node) not in core:
            continue  # q/k/v projection: keep, do not walk into the previous layer
        if node.op_type in ("Shape", "Size"):
            continue  # depends on a shape only: do not drag in the layer norm etc.
        for i in node.input:
            src = producer.get(i)
            if src is not None and id(src) not in block:
                block.add(id(src))
                stack.append(src)
    return [n for n in graph.node if id(n) in block]


def _const_like(name, consts, producer, depth: int = 3) -> bool:
    """A constant, or a Transpose/Cast/Reshape of one (legacy exports transpose weights)."""
    if name in consts:
        return True
    node = producer.get(name)
    if node is None or depth == 0 or node.op_type not in ("Transpose", "Cast", "Reshape", "Identity"):
        return False
    return _const_like(node.input[0], consts, producer, depth - 1)


def _small_constants(model) -> dict[str, str]:
    """Printable values of constants with at most 4 elements (scales, fill values, axes)."""
    import onnx

    tensors = {i.name: i for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    tensors[n.output[0]] = a.t
    out = {}
    for name, t in tensors.items():
        size = 1
        for d in t.dims:
            size *= d
        if size > 4 or t.data_location == onnx.TensorProto.EXTERNAL:
            out[name] = f"W{list(t.dims)}"  # never read (external) weight data
            continue
        arr = onnx.numpy_helper.to_array(t)
        out[name] = f"{arr.tolist()}" if arr.ndim else f"{arr.item():.6g}"
    return out


def describe(model, nodes, float_only: bool = False) -> list[str]:
    import onnx

    types = _types(model)
    values = _small_constants(model)
    lines = []
    for node in nodes:
        out_t = [types.get(o, "?") for o in node.output]
        is_int = all(t.startswith(("int", "bool")) for t in out_t if t != "?") and out_t != ["?"]
        if float_only and is_int:
            continue
        attrs = []
        for a in node.attribute:
            if a.name in _ATTRS:
                val = onnx.helper.get_attribute_value(a)
                if isinstance(val, onnx.TensorProto):
                    arr = onnx.numpy_helper.to_array(val)
                    val = arr.tolist() if arr.size <= 4 else f"tensor{list(arr.shape)}"
                elif isinstance(val, bytes):
                    val = val.decode()
                attrs.append(f"{a.name}={val}")
        domain = f"{node.domain}::" if node.domain else ""
        tag = "int " if is_int else "    "
        ins = ", ".join(f"{_short(i)}={values[i]}" if i in values else _short(i) for i in node.input)
        lines.append(f"{tag}{domain}{node.op_type:<18s} {' '.join(attrs):<28s} -> {','.join(out_t)}   <- {ins}")
    return lines


def _short(name: str) -> str:
    return name if len(name) <= 40 else "…" + name[-39:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print one attention block of a KV-cache ONNX export.")
    parser.add_argument("model", type=Path)
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--float-only", action="store_true", help="hide int64/bool shape and mask arithmetic")
    args = parser.parse_args(argv)
    model = _load(args.model)
    nodes = attention_block(model, args.layer)
    print(f"# {args.model}  opset {[(o.domain or 'ai.onnx', o.version) for o in model.opset_import]}  "
          f"{len(nodes)} nodes in layer {args.layer} attention")
    print("\n".join(describe(model, nodes, args.float_only)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
