"""proto_scan.load_proto: an ONNX file read without its inline weights (issue #30)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tinyserve_trt.export import weights
from tinyserve_trt.export.loader import load_source
from tinyserve_trt.export.errors import InputError
from tinyserve_trt.export.proto_scan import ScanError, load_proto


def _model(rng) -> onnx.ModelProto:
    w = numpy_helper.from_array(rng.standard_normal((64, 48)).astype(np.float16), "w")
    b = numpy_helper.from_array(rng.standard_normal(48).astype(np.float16), "b")  # 96 bytes: stays inline
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y0"]), helper.make_node("Add", ["y0", "b"], ["y"])],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 48])], [w, b])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_inline_weights_become_references_into_the_file(tmp_path):
    rng = np.random.default_rng(0)
    model = _model(rng)
    path = tmp_path / "model.onnx"
    onnx.save_model(model, str(path))
    proto = load_proto(path)
    by_name = {t.name: t for t in proto.graph.initializer}
    info = weights.external_info(by_name["w"])
    assert info["location"] == "model.onnx" and info["length"] == 64 * 48 * 2
    assert not by_name["w"].raw_data
    assert weights.external_info(by_name["b"]) is None and by_name["b"].raw_data  # small: inline
    assert (weights.read_array(by_name["w"], tmp_path) == numpy_helper.to_array(model.graph.initializer[0])).all()
    assert list(proto.graph.node) == list(model.graph.node)  # everything else as it was
    import onnxruntime as ort

    x = rng.standard_normal((2, 64)).astype(np.float16)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    so = weights.session_options(ort.SessionOptions(), tmp_path)
    got = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert (got == want).all()


def test_external_data_model_reads_as_onnx_load_does(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save_model(_model(np.random.default_rng(1)), str(path), save_as_external_data=True, location="w.data",
                    size_threshold=0)
    assert load_proto(path) == onnx.load(str(path), load_external_data=False)


@pytest.mark.parametrize("cut", [1, 100, 2000])
def test_truncated_file_is_an_error(tmp_path, cut):
    path = tmp_path / "model.onnx"
    onnx.save_model(_model(np.random.default_rng(2)), str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    with pytest.raises((ScanError, Exception)) as e:
        load_proto(path)
    assert not isinstance(e.value, (MemoryError, RecursionError))
    with pytest.raises(InputError, match="not a readable ONNX model"):
        load_source(path)


def test_not_protobuf_is_a_scan_error(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(ScanError):
        load_proto(path)
