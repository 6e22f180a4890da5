"""Bytes a decode step reads: weights from a package's graph, KV from its geometry (hand-counted cases)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tinyserve_dev.peers.step_bytes import StepBytes, StepGeometry, kv_bytes, sparse_applies, weight_bytes


def graph_file(tmp_path, tied: bool):
    """ids -> Gather(E [50, 8]) -> MatMul(W [8, 50]) + bias [50]; ``tied``: the MatMul reads E too."""
    e = numpy_helper.from_array(np.zeros((50, 8), np.float32), "E")
    w = numpy_helper.from_array(np.zeros((8, 50), np.float32), "W")
    b = numpy_helper.from_array(np.zeros(50, np.float32), "bias")
    nodes = [helper.make_node("Gather", ["E", "ids"], ["h"]), helper.make_node("MatMul", ["h", "W"], ["m"]),
             helper.make_node("Add", ["m", "bias"], ["logits"])]
    if tied:
        nodes.append(helper.make_node("MatMul", ["h", "E"], ["unused"]))  # shape-wise odd, only uses count
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], [e, w, b])
    path = tmp_path / f"model{int(tied)}.onnx"
    onnx.save(helper.make_model(graph), str(path))
    return path


def test_weights_count_one_embedding_row_per_sequence(tmp_path):
    path = graph_file(tmp_path, tied=False)
    assert weight_bytes(path, 1) == 8 * 50 * 4 + 50 * 4 + 1 * 8 * 4
    assert weight_bytes(path, 3) == 8 * 50 * 4 + 50 * 4 + 3 * 8 * 4


def test_a_table_read_whole_elsewhere_counts_whole(tmp_path):
    assert weight_bytes(graph_file(tmp_path, tied=True), 2) == 50 * 8 * 4 + 8 * 50 * 4 + 50 * 4


GEO = StepGeometry(num_layers=4, num_kv_heads=2, head_dim=8, page_size=16, dense_layers=1, sub_page_size=4,
                   candidate_share=0.5, sink_pages=1, recent_pages=1)
ROW = 2 * 8 * 4  # one token's K (or V) in one layer: 2 KV heads x 8 dims x fp32


def test_dense_reads_every_cached_token():
    assert kv_bytes(GEO, 1000, 2) == 2 * 4 * 2 * 1000 * ROW  # batch x layers x (K, V) x tokens x row
    assert kv_bytes(GEO, 1000, 1, kv_dtype="float16") == 4 * 2 * 1000 * ROW // 2  # llama.cpp's f16 cache


def test_below_the_ratio_the_sparse_row_decodes_dense():
    assert not sparse_applies(100, 64, 4.0)  # 101 < 4 x 64
    assert kv_bytes(GEO, 100, 1, budget=64, sparse_min_ratio=4.0) == kv_bytes(GEO, 100, 1)
    assert kv_bytes(GEO, 60, 1, budget=64) == kv_bytes(GEO, 60, 1)  # the budget covers the context


def test_two_level_sparse_layer_hand_counted():
    # 1024 tokens = 64 pages; forced 2 (sink + recent); candidates max(floor(0.5 x 64), 64 // 16) = 32 pages,
    # 30 of them scored: 30 pages x 4 sub-pages x 8 dims uint8 codes per KV head = 960 B, x 2 heads.
    # kept: max(64 // 4, 2 x 4) = 16 sub-pages = 64 tokens of K and V. Bounds: min + max of 64 pages.
    sparse_layer = 2 * 64 * ROW + 960 * 2 + 2 * 64 * ROW
    dense_layer = 2 * 1024 * ROW
    assert sparse_layer == 18304
    assert kv_bytes(GEO, 1024, 1, budget=64, sparse_min_ratio=4.0) == dense_layer + 3 * sparse_layer
    assert kv_bytes(GEO, 1024, 3, budget=64, sparse_min_ratio=4.0) == 3 * (dense_layer + 3 * sparse_layer)


def test_single_level_sparse_layer_hand_counted():
    geo = StepGeometry(num_layers=4, num_kv_heads=2, head_dim=8, page_size=16, dense_layers=1)
    # kept: max(64 // 16, 2 forced) = 4 pages = 64 tokens; bounds of all 64 pages; no sub-page codes.
    assert kv_bytes(geo, 1024, 1, budget=64) == 2 * 1024 * ROW + 3 * (2 * 64 * ROW + 2 * 64 * ROW)


def test_share_of_bandwidth():
    assert StepBytes(weights=900, kv=100).share(seconds=0.5, bandwidth=4000.0) == pytest.approx(0.5)


def test_geometry_of_a_fixture_package(llama):
    from tinyserve_trt.runtime.model_package import ModelPackage

    _, pkg, manifest = llama
    package = ModelPackage.load(pkg)
    geo = StepGeometry.of_package(package)
    assert (geo.num_layers, geo.num_kv_heads, geo.head_dim, geo.page_size, geo.dtype) == (
        manifest["num_layers"], manifest["num_kv_heads"], manifest["head_dim"], manifest["page_size"],
        manifest["dtype"])
    assert geo.dense_layers == min(manifest.get("dense_layers", 0), manifest["num_layers"])
    one, two, three = (weight_bytes(package.model_path, b) for b in (1, 2, 3))
    graph = onnx.load(str(package.model_path), load_external_data=False).graph
    embed = next(t for t in graph.initializer if t.dims and t.dims[0] == manifest["vocab_size"]
                 and any(n.op_type == "Gather" and n.input[0] == t.name for n in graph.node))
    assert two - one == three - two == embed.dims[1] * 4  # one fp32 embedding row per extra sequence


def test_bad_geometry_is_refused():
    with pytest.raises(ValueError, match="sub_page_size 5 must divide page_size 16"):
        StepGeometry(num_layers=1, num_kv_heads=1, head_dim=8, page_size=16, sub_page_size=5)
    with pytest.raises(ValueError, match="dtype"):
        StepGeometry(num_layers=1, num_kv_heads=1, head_dim=8, page_size=16, dtype="int8")
