"""model.ort.onnx runs each native layer as one node: ``native_layer.FuseNativeLayer`` folds the
head split, rotary and transposes around the native op node into
``tinyserve.cpu::QueryAwareSparseAttentionLayer``. The structure (what goes, what stays), what it
leaves alone, and that the fused graph gives the unfused graph's logits, dense and selecting, over
prefill chunks and decode steps."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from tinyserve_trt.contracts.manifest import MANIFEST_FILE, MODEL_FILE
from tinyserve_trt.cpu import native as cpu_native
from tinyserve_trt.export import ort_passes
from tinyserve_trt.export.config import ExportConfig
from tinyserve_trt.export.native_layer import FuseNativeLayer
from tinyserve_trt.export.ort_graph import prepared_graph
from tinyserve_trt.export.ort_opset import ORT_OPSET
from tinyserve_trt.export.pipeline import export_model
from tinyserve_trt.export.validate import graph_session, paged_logits, sparse_lengths

CONFIG = ExportConfig(page_size=8, sub_page_size=4, dense_layers=1, validate=False)
LAYER = (cpu_native.DOMAIN, cpu_native.LAYER_OP_TYPE)
OP = (cpu_native.DOMAIN, cpu_native.OP_TYPE)


@pytest.fixture(scope="module")
def packages(export_fixture, tmp_path_factory):
    root = tmp_path_factory.mktemp("native_layer")
    cache = {}

    def get(kind):
        if kind not in cache:
            export_model(export_fixture(kind, "legacy_eager") / MODEL_FILE, root / kind, CONFIG, quiet=True)
            cache[kind] = root / kind, json.loads((root / kind / MANIFEST_FILE).read_text())
        return cache[kind]
    return get


def _ops(model: onnx.ModelProto) -> dict:
    out: dict = {}
    for n in model.graph.node:
        out[(n.domain, n.op_type)] = out.get((n.domain, n.op_type), 0) + 1
    return out


def _unfused(proto: onnx.ModelProto) -> onnx.ModelProto:
    """prepared_graph(native=True) without FuseNativeLayer: the native op nodes and the layer's own nodes."""
    work = ir.serde.deserialize_model(proto)
    passes = [p for p in ort_passes.post_passes(True, True) if not isinstance(p, FuseNativeLayer)]
    ir.passes.PassManager(passes)(work)
    return ir.serde.serialize_model(work)


@pytest.mark.parametrize("kind,rotary", [("llama", True), ("qwen2", True), ("gpt2", False)])
def test_every_layer_becomes_one_node(packages, kind, rotary):
    pkg, manifest = packages(kind)
    proto = onnx.load(str(pkg / MODEL_FILE), load_external_data=False)
    fused = prepared_graph(proto, opset=ORT_OPSET, native=True)
    ops = _ops(fused)
    assert ops.get(LAYER) == manifest["num_layers"] and OP not in ops
    # the rotary fused into the layer nodes, no transposes left, the layers' outputs kept by name
    assert ops.get(("com.microsoft", "RotaryEmbedding"), 0) == 0 and ops.get(("", "Transpose"), 0) == 0
    layers = [n for n in fused.graph.node if (n.domain, n.op_type) == LAYER]
    assert all(bool(n.input[3]) == rotary for n in layers)  # rotary_positions, when the model has rope
    outputs = {o.name for o in fused.graph.output}
    for i, n in enumerate(layers):
        assert list(n.output[1:]) == [f"selected_pages.{i}", f"new_key.{i}", f"new_value.{i}"]
        assert set(n.output[1:]) <= outputs
    assert len(fused.graph.node) < len(_unfused(proto).graph.node)


@pytest.mark.skipif(cpu_native.available() is not None, reason=f"native kernel: {cpu_native.available()}")
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_fused_graph_gives_the_unfused_logits(packages, kind):
    pkg, manifest = packages(kind)
    proto = onnx.load(str(pkg / MODEL_FILE), load_external_data=False)
    ps = manifest["page_size"]
    sessions = [graph_session(g, pkg) for g in (_unfused(proto), prepared_graph(proto, opset=ORT_OPSET, native=True))]
    for budget in (0, 3 * ps):  # dense, then selecting: prefill chunks and decode steps
        a, b = (paged_logits(s, manifest, budget, sparse_lengths(ps)) for s in sessions)
        assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) <= 1e-4, budget


def test_a_layer_whose_output_is_read_elsewhere_is_left_alone(packages):
    """The op's output read by a second node (the layer node would not write that [B, H, S, D]
    value): that layer keeps its nodes; the others still fuse."""
    pkg, manifest = packages("llama")
    work = ir.serde.deserialize_model(onnx.load(str(pkg / MODEL_FILE), load_external_data=False))
    passes = ort_passes.post_passes(True, True)
    at = next(i for i, p in enumerate(passes) if isinstance(p, FuseNativeLayer))
    ir.passes.PassManager(passes[:at])(work)
    first = next(n for n in work.graph if (n.domain, n.op_type) == OP)
    extra = ir.node("Identity", [first.outputs[0]], outputs=[ir.Value(name="peek")])
    work.graph.append(extra)
    work.graph.outputs.append(extra.outputs[0])
    fuse = FuseNativeLayer()
    fuse(work)
    assert fuse.count == manifest["num_layers"] - 1
    assert first.graph is work.graph and (first.domain, first.op_type) == OP
