"""bfloat16 sources: upcast to float32 at load (issue #30).

ONNX Runtime's CPU EP has no bfloat16 kernels (MatMul, Softmax, Where, ...), so a bf16 export can
be neither probed nor validated as it is, and the op's pages are float32 or float16. bf16 is the
top half of float32, so widening is exact: the weights are streamed into one float32 data file
(``weights.write_data(upcast_bf16=True)``, a chunk at a time), and every bf16 type in the graph -
inputs, outputs, value infos, ``Cast(to=bf16)``, constants, subgraphs - becomes float32. The
widened source is what the exporter rewrites *and* what it validates against (saved beside its
data file), so validation measures the rewrite alone, at float32 tolerance; the package holds
float32 weights (2x the source's bytes) and float32 KV pages, or float16 ones with ``--fp16``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from . import weights

BF16, F32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
REFERENCE = "source.onnx"  # the widened source, in the load's scratch folder


def is_bf16(proto: onnx.ModelProto) -> bool:
    """Any bfloat16 graph input, output or initializer."""
    g = proto.graph
    return any(v.type.tensor_type.elem_type == BF16 for v in list(g.input) + list(g.output)) or \
        any(t.data_type == BF16 for t in g.initializer)


def upcast(proto: onnx.ModelProto, base_dir: Path, scratch: Path) -> Path:
    """Widen ``proto`` to float32 in place, its large weights into ``scratch/source.data``;
    returns the widened model's path (``scratch/source.onnx``), which sessions of the source
    load instead of the user's file."""
    scratch.mkdir(parents=True, exist_ok=True)
    weights.write_data(proto, base_dir, scratch / "source.data", upcast_bf16=True)
    for t in proto.graph.initializer:  # the small ones left inline
        _widen_tensor(t)
    _widen_graph(proto.graph)
    for f in proto.functions:
        for node in f.node:
            _widen_node(node)
    path = scratch / REFERENCE
    onnx.save_model(proto, str(path))  # weights external: a small file
    return path


def _widen_tensor(t: onnx.TensorProto) -> None:
    if t.data_type != BF16:
        return
    if weights.external_info(t) is not None:
        raise ValueError(f"bf16 initializer {t.name} still external after the upcast")  # write_data took them all
    raw = t.raw_data if t.HasField("raw_data") else np.asarray(t.int32_data, np.uint16).astype("<u2").tobytes()
    t.ClearField("int32_data")
    t.raw_data = weights.bf16_to_f32(raw)
    t.data_type = F32


def _widen_type(tp: onnx.TypeProto) -> None:
    kind = tp.WhichOneof("value")
    if kind == "tensor_type" and tp.tensor_type.elem_type == BF16:
        tp.tensor_type.elem_type = F32
    elif kind in ("sequence_type", "optional_type"):
        _widen_type(getattr(tp, kind).elem_type)


def _widen_graph(g: onnx.GraphProto) -> None:
    for v in list(g.input) + list(g.output) + list(g.value_info):
        _widen_type(v.type)
    for t in g.initializer:
        _widen_tensor(t)
    for node in g.node:
        _widen_node(node)


def _widen_node(node: onnx.NodeProto) -> None:
    for a in node.attribute:
        if a.type == onnx.AttributeProto.INT and a.name in ("to", "dtype") and a.i == BF16:
            a.i = F32
        elif a.type == onnx.AttributeProto.TENSOR:
            _widen_tensor(a.t)
        elif a.type == onnx.AttributeProto.GRAPH:
            _widen_graph(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            for g in a.graphs:
                _widen_graph(g)
