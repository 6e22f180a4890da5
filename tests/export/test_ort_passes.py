"""ort_passes: the ORT graph's post-passes are one ordered list of onnx-ir passes, and weights stay on disk.

The pipeline's passes are ``ir.passes.PassBase`` instances run on one ``ir.Model``;
a model whose weight is a large external initializer goes through
``prepared_graph`` without its bytes being read (peak RSS grows by far less than
the weight) and comes out pointing at the same file, offset and length.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tinyserve_trt.export.ort_graph import prepared_graph
from tinyserve_trt.export.ort_passes import post_passes

ROWS, COLS = 1024, 65536  # a 256 MiB float32 weight
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("contrib,native", [(True, True), (False, False)])
def test_post_passes_are_onnx_ir_passes_in_order(contrib, native):
    import onnx_ir as ir

    passes = post_passes(contrib, native)
    assert passes and all(isinstance(p, ir.passes.PassBase) for p in passes)
    names = [type(p).__name__ for p in passes]
    assert names.index("InlinePass") < names.index("ShareShapeDims") < names.index("MergeIdenticalNodes")
    assert ("FuseSkipRmsNorm" in names) == ("FuseRotary" in names) == contrib
    assert names[-1] == "DropOutputIdentities"  # after every pass that reads the graph's values
    if native:  # the op nodes become native nodes before inlining would dissolve them
        assert names[0] == "ReplaceNativeCalls" and names.index("ReplaceNativeCalls") < names.index("InlinePass")
    else:
        assert "ReplaceNativeCalls" not in names


def _model(folder: Path, cols: int = COLS) -> Path:
    """x [B, ROWS] @ W [ROWS, cols], then a Reshape by the product's Shape (which the passes resolve);
    W external (a sparse file: reading it would still cost its size in memory) at ``COLS``, inline
    and small otherwise (the warm-up model)."""
    if cols == COLS:
        data = folder / "model.onnx.data"
        with open(data, "wb") as f:
            f.truncate(ROWS * COLS * 4)
        w = onnx.TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[ROWS, COLS])
        w.data_location = TensorProto.EXTERNAL
        for key, value in (("location", data.name), ("offset", "0"), ("length", str(ROWS * COLS * 4))):
            w.external_data.add(key=key, value=value)
    else:
        w = onnx.numpy_helper.from_array(np.zeros((ROWS, cols), np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("Shape", ["h"], ["shape"]),
             helper.make_node("Reshape", ["h", "shape"], ["y"])]
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", ROWS])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", cols])], [w])
    path = folder / ("model.onnx" if cols == COLS else "small.onnx")
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


SCRIPT = """
import json, resource, sys, onnx
from tinyserve_trt.export.ort_graph import prepared_graph
prepared_graph(onnx.load(sys.argv[2]), native=False)  # warm: imports and first-call allocations
proto = onnx.load(sys.argv[1], load_external_data=False)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = prepared_graph(proto, contrib_ops=True, native=False)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
w = next(t for t in out.graph.initializer if t.name == "W")
print(json.dumps(dict(grew_kib=after - before, external=w.data_location == onnx.TensorProto.EXTERNAL,
                      info={e.key: e.value for e in w.external_data}, raw=len(w.raw_data),
                      shapes=[list(n.input) for n in out.graph.node if n.op_type == "Shape"])))
"""


def test_prepared_graph_reads_no_external_weight(tmp_path):
    path, small = _model(tmp_path), _model(tmp_path, cols=16)
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(path), str(small)], capture_output=True, text=True, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    size_kib = ROWS * COLS * 4 // 1024
    assert got["grew_kib"] < size_kib // 8, got  # peak RSS: far below the weight's 256 MiB
    assert got["external"] and got["raw"] == 0
    assert got["info"] == {"location": "model.onnx.data", "offset": "0", "length": str(ROWS * COLS * 4)}
    assert got["shapes"] == [["x"]]  # the passes ran: h's Shape became x's shared dim and a constant


def test_a_large_inline_weight_comes_through_unchanged(tmp_path):
    """Shape inference sees a large inline weight as a placeholder reference (inferred_shapes.py);
    the weight itself is serialized back as it was, and the shapes were still inferred."""
    model = onnx.load(str(_model(tmp_path, cols=64)))  # W: 256 KiB inline
    w = np.random.default_rng(0).standard_normal((ROWS, 64)).astype(np.float32)
    model.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(w, "W"))
    out = prepared_graph(model, native=False)
    got = next(t for t in out.graph.initializer if t.name == "W")
    assert got.data_location != TensorProto.EXTERNAL and np.array_equal(onnx.numpy_helper.to_array(got), w)
    assert [list(n.input) for n in out.graph.node if n.op_type == "Shape"] == [["x"]]


def test_function_nodes_are_named_before_inlining():
    """onnx-ir's InlinePass finds a free name by counting up from the original's: the op's unnamed
    body nodes (all "node") made that quadratic in the layers; named, each collides once a layer."""
    import onnx_ir as ir
    from onnx_ir.passes.common import InlinePass

    from tests.export.test_shared_shapes import _layers_model
    from tinyserve_trt.export.ort_passes import NameFunctionNodes
    from tinyserve_trt.ops import schema

    model = ir.serde.deserialize_model(_layers_model(3, schema.OpAttributes()))
    assert any(not n.name for f in model.functions.values() for n in f.all_nodes())  # as ops/ builds them
    NameFunctionNodes()(model)
    for f in model.functions.values():
        names = [n.name for n in f.all_nodes()]
        assert all(names) and len(set(names)) == len(names)
    InlinePass()(model)
    names = [n.name for n in model.graph.all_nodes() if n.name]  # the test model's own nodes are unnamed
    assert len(set(names)) == len(names) and not any(n.startswith("node") for n in names)
    passes = [type(p).__name__ for p in post_passes()]
    assert passes.index("NameFunctionNodes") == passes.index("InlinePass") - 1
