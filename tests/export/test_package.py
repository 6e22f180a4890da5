"""A package holds its weights once: model.onnx.data, read by model.onnx and ORT's optimized graph.

The model here is a tiny LLaMA wide enough (hidden 256, ~7 MB of weights) that
the two graph files (~80 KB each) do not hide a second copy of the weights:
before this, the package was ~2x the weights (model.onnx + model.ort.onnx.data).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from tinyserve_trt.contracts.manifest import MODEL_DATA_FILE, ORT_GRAPH_FILE, Manifest
from tinyserve_trt.export import polygraphy_data
from tinyserve_trt.export.package import package_bytes


@pytest.fixture(scope="module")
def wide_package(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tinyserve_dev.models.tiny_models import TinyModelConfig, build_tiny_model
    from tinyserve_trt.export.config import ExportConfig
    from tinyserve_trt.export.hf.torch_export import export_causal_lm
    from tinyserve_trt.export.pipeline import export_model

    root = tmp_path_factory.mktemp("wide")
    model = build_tiny_model(TinyModelConfig(kind="llama", vocab_size=1024, hidden_size=256, num_layers=2,
                                             num_heads=4, num_kv_heads=2, intermediate_size=512),
                             attn_implementation="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = export_causal_lm(model, root / "src" / "model.onnx", "legacy_eager")
    report = export_model(src, root / "pkg", ExportConfig(page_size=4, token_budget=16, dense_layers=1), quiet=True)
    return report


def _external_locations(path) -> set[str]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return {e.value for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
            for e in t.external_data if e.key == "location"}


def test_package_is_at_most_1_1x_the_weights(wide_package):
    import onnx
    from onnx import numpy_helper

    pkg = wide_package.outdir
    model = onnx.load(str(pkg / "model.onnx"))  # with its external data
    weights = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    assert weights > 5e6 and wide_package.weight_bytes == weights
    size = package_bytes(pkg)
    assert size == wide_package.size_bytes
    assert size <= 1.1 * weights, {p.name: p.stat().st_size for p in pkg.iterdir()}
    assert (pkg / MODEL_DATA_FILE).stat().st_size <= weights  # the one copy


def test_ort_graph_reads_the_portable_models_weights(wide_package):
    pkg = wide_package.outdir
    opt = Manifest.load(pkg).ort_optimized
    assert opt is not None and opt.file == ORT_GRAPH_FILE and opt.weights == MODEL_DATA_FILE
    assert opt.shared_bytes > 5e6 and opt.own_bytes == 0 and not (pkg / (ORT_GRAPH_FILE + ".data")).exists()
    assert _external_locations(pkg / ORT_GRAPH_FILE) == {MODEL_DATA_FILE}
    assert _external_locations(pkg / "model.onnx") == {MODEL_DATA_FILE}


def test_ort_graph_computes_what_the_portable_model_does(wide_package):
    import onnx
    import onnxruntime as ort

    from tinyserve_trt.export.native_decode import session_options

    pkg = wide_package.outdir
    feeds = polygraphy_data.decode_feeds(pkg, batch=2, context=30, seed=3)
    manifest = json.loads((pkg / "tinyserve.json").read_text())
    logits = manifest["io"]["outputs"]["logits"]
    outs = []
    for file in ("model.onnx", ORT_GRAPH_FILE):  # model.ort.onnx decodes on the native kernel (its library)
        so = session_options(onnx.load(str(pkg / file), load_external_data=False))
        sess = ort.InferenceSession(str(pkg / file), so, providers=["CPUExecutionProvider"])
        outs.append(sess.run([logits], feeds)[0])
    assert np.isfinite(outs[0]).all() and np.abs(outs[0]).max() > 0
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-4, atol=1e-4)


def test_summary_prints_the_package_size_against_the_weights(wide_package, capsys):
    from tinyserve_trt.export.config import ExportConfig
    from tinyserve_trt.export.report import print_summary

    print_summary(wide_package, ExportConfig(page_size=4, token_budget=16, dense_layers=1))
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("package size"))
    ratio = wide_package.size_bytes / wide_package.weight_bytes
    assert f"{ratio:.2f}x the weights" in line and "MiB" in line
