"""Run the source model once with chosen inner values as extra outputs.

The rules match structure; what structure cannot tell (head counts when dims
are symbolic, a scale computed from shapes, what a mask really masks) is read
off one run of the original model in ONNX Runtime.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from .graph_io import SourceIO
from .weights import session_options


def weights_dir(model: ir.Model) -> str | None:
    """The folder a model's external tensors are read from (None: every tensor in memory)."""
    for v in model.graph.initializers.values():
        if isinstance(v.const_value, ir.ExternalTensor):
            return v.const_value.base_dir
    return None


def source_feeds(graph: ir.Graph, io: SourceIO, past_inputs: list[ir.Value], batch: int, past: int, seq: int,
                 vocab_hint: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    """Feeds for one step of the original model: random ids, all-ones mask,
    positions past..past+seq-1, random past K/V of length ``past``."""
    rng = np.random.default_rng(seed)
    np_int = {"INT64": np.int64, "INT32": np.int32}
    feeds = {io.input_ids.name: rng.integers(0, vocab_hint, (batch, seq)).astype(np_int[io.input_ids.dtype.name])}
    if io.attention_mask is not None:
        feeds[io.attention_mask.name] = np.ones((batch, past + seq), np_int[io.attention_mask.dtype.name])
    if io.position_ids is not None:
        pos = np.broadcast_to(np.arange(past, past + seq), (batch, seq))
        feeds[io.position_ids.name] = pos.astype(np_int[io.position_ids.dtype.name])
    for v in past_inputs:
        d = list(v.shape.dims)
        shape = [batch, d[1], past, d[3]]
        feeds[v.name] = (0.5 * rng.standard_normal(shape)).astype(v.dtype.numpy())
    return feeds


def run_with_outputs(model: ir.Model, values: list[ir.Value], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Values by name after one run of ``model`` (which is not modified; its external weights are
    read from their folder, not copied into the proto)."""
    proto = ir.to_proto(model)
    have = {o.name for o in proto.graph.output}
    for v in values:
        if v.name not in have:
            proto.graph.output.append(onnx.ValueInfoProto(name=v.name))
            have.add(v.name)
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep inner values alive
    so.log_severity_level = 4  # a failing long probe is expected for learned positions
    so.add_session_config_entry("session.disable_prepacking", "1")  # no second copy of the MatMul weights
    session_options(so, weights_dir(model))
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [v.name for v in values]
    return dict(zip(names, sess.run(names, feeds)))
