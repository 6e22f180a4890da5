"""tinyserve-export --calibration: the INT8 cold tier in the package (issue #6).

Structure (every op node is the ``_int8`` overload with the 14 inputs, cold-pool
shapes per the schema and the calibration's granularities), the manifest
(cold-tier I/O names, policy parameters, all-hot validation), and the
one-line exit-2 refusals of a calibration that does not fit the export.
"""

from __future__ import annotations

import json

import onnx
import pytest

from tests.tiny_models import write_calibration
from tinyserve_trt.export import cli
from tinyserve_trt.contracts.cold_tier import DEFAULT_HOT_FRACTION
from tinyserve_trt.export.config import ExportConfig
from tinyserve_trt.ops import schema
from tinyserve_trt.runtime.model_package import ModelPackage


def _dims(value_info):
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def test_every_layer_takes_the_cold_pools(llama_cold):
    _, pkg, manifest = llama_cold
    model = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    ops = [n for n in model.graph.node if n.op_type == schema.OP_TYPE]
    assert len(ops) == manifest["num_layers"]
    assert all(n.overload.endswith("_int8") and len(n.input) == schema.NUM_TIERED_INPUTS for n in ops)
    assert {f.overload for f in model.functions} == {n.overload for n in ops}
    inputs = {i.name: i for i in model.graph.input}
    hkv, ps, d = manifest["num_kv_heads"], manifest["page_size"], manifest["head_dim"]
    for i, (node, layer) in enumerate(zip(ops, manifest["io"]["layers"])):
        assert list(node.input[schema.NUM_REQUIRED_INPUTS:]) == [layer[r] for r in schema.COLD_INPUTS]
        assert layer["key_cache_int8"] == f"key_cache_int8.{i}" and layer["value_scale"] == f"value_scale.{i}"
        shapes = {r: _dims(inputs[layer[r]]) for r in schema.COLD_INPUTS}
        assert shapes["key_cache_int8"] == shapes["value_cache_int8"] == ["num_cold_pages", hkv, ps, d]
        assert shapes["key_scale"] == ["num_cold_pages", hkv, 1, d]  # K per channel
        assert shapes["value_scale"] == ["num_cold_pages", hkv, ps, 1]  # V per token
        assert inputs[layer["key_cache_int8"]].type.tensor_type.elem_type == onnx.TensorProto.INT8
        assert inputs[layer["key_scale"]].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        assert _dims(inputs[layer["key_min"]])[0] == "total_pages"


def test_manifest_records_the_tier_and_validation_ran(llama_cold):
    _, pkg, manifest = llama_cold
    tier = manifest["cold_tier"]
    assert tier["inputs"] == list(schema.COLD_INPUTS)
    assert (tier["k_granularity"], tier["v_granularity"]) == ("channel", "token")
    assert (tier["hot_fraction"], tier["sink_pages"], tier["recent_pages"]) == (0.5, 1, 2)
    assert tier["calibration"]["file"] == "calibration.json" and tier["calibration"]["policy"] == "query_aware"
    assert (pkg / "calibration.json").is_file() and (pkg / "calibration.npz").is_file()
    v = manifest["validation"]
    assert v["max_abs_logit_diff"] <= v["tolerance"] and "all hot" in v["pages"]
    assert ModelPackage.load(pkg).cold_tier == tier


def test_cold_pages_without_calibration_uses_the_runtime_defaults(llama, tmp_path):
    from tinyserve_trt.export.pipeline import export_model
    from tinyserve_trt.export.report import print_summary
    from tinyserve_trt.ops.cold_codec import INT4_FORMAT_VERSION

    src, _, manifest = llama
    config = ExportConfig(page_size=4, token_budget=16, dense_layers=1, cold_pages=True, validate=False)
    report = export_model(src, tmp_path / "pkg", config, quiet=True)
    tier = json.loads((tmp_path / "pkg" / "tinyserve.json").read_text())["cold_tier"]
    assert tier["cold_format_version"] == INT4_FORMAT_VERSION == 3
    # the summary prices the cold page against an FP16 page, by the codec's bytes
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_summary(report, config)
    line = next(ln for ln in out.getvalue().splitlines() if ln.startswith("cold page"))
    D = report.head_dim  # ps 4: K 2D + 2 (placeholder) + V 2D + 4 * 2 * (D/16) * 2 + min/max 4D bytes
    want = (4 * D + 2 + 4 * 2 * (D // 16) * 2 + 4 * D) / ((2 * 4 * D + 2 * D) * 2)
    assert f"int4 (format 3): {want:.3f} of an FP16 page" in line, line
    # no calibration: the export's own sensitivity pass picks the INT8 layers (tests/export/test_auto_int8.py)
    assert "int8 layers 0 (auto: layer sensitivity on the built-in text, 2 prompts)" in line, line
    assert tier["calibration"] is None and (tier["k_granularity"], tier["v_granularity"]) == ("channel", "token")
    assert not (tmp_path / "pkg" / "calibration.json").exists()
    # every op node names its cold format twice: the overload (ONNX function) and the
    # cold_format attribute (the TensorRT plugin's field); both are the manifest's
    import onnx

    from tinyserve_trt.ops import schema
    from tinyserve_trt.ops.node import node_attributes

    ops = [n for path in (tmp_path / "pkg").glob("*.onnx")
           for n in onnx.load(str(path), load_external_data=False).graph.node if n.op_type == schema.OP_TYPE]
    assert ops and tier["cold_format"] == "int4"  # the ort backend's default
    assert tier["int8_layers"] == [0] and tier["int8_layers_source"].startswith("auto")
    assert tier["hot_fraction"] == DEFAULT_HOT_FRACTION["int4"] == 0.15  # the INT4 default, not INT8's 0.5
    for n in ops:  # the picked layer INT8, the others INT4
        fmt = "int8" if n.overload.startswith("dense") else "int4"  # layer 0 is the dense one
        assert node_attributes(n).cold_format == schema.overload_cold_format(n.overload) == fmt


def _run(capsys, *argv):
    code = cli.main([*map(str, argv)])
    _, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) <= 1 and "Traceback" not in err, err
    return code, lines[0] if lines else ""


@pytest.mark.parametrize("fields,flags,message", [
    (dict(page_size=8), (), "calibrated with page size 8"),
    (dict(k_absmax=None), (), "is for a model with"),
])
def test_a_calibration_that_does_not_fit_exits_2(capsys, tmp_path, llama, fields, flags, message):
    import numpy as np

    src, _, manifest = llama
    if fields.get("k_absmax", 0) is None:  # one layer too many
        fields = dict(k_absmax=np.ones((manifest["num_layers"] + 1, manifest["num_kv_heads"], manifest["head_dim"]),
                                       np.float32),
                      v_absmax=np.ones((manifest["num_layers"] + 1, manifest["num_kv_heads"]), np.float32))
    cal = write_calibration(tmp_path / "cal.json", manifest, **fields)
    code, line = _run(capsys, src, "-o", tmp_path / "out", "-q", "--page-size", 4, "--calibration", cal,
                      "--no-validate", *flags)
    assert code == 2 and message in line
    assert not (tmp_path / "out").exists()


def test_an_unreadable_calibration_exits_2(capsys, tmp_path, llama):
    (tmp_path / "cal.json").write_text("{}")
    code, line = _run(capsys, llama[0], "-o", tmp_path / "out", "-q", "--calibration", tmp_path / "cal.json")
    assert code == 2 and "calibration file" in line


@pytest.fixture(scope="module")
def int4_mixed(llama, tmp_path_factory):
    """The tiny LLaMA as a two-level INT4 package whose layer 0 (its dense layer) keeps INT8 cold
    pages (``int8_layers``), validated by ORT at export."""
    from tinyserve_trt.export.pipeline import export_model

    src, _, manifest = llama
    pkg = tmp_path_factory.mktemp("int4-mixed") / "pkg"
    config = ExportConfig(page_size=4, token_budget=8, dense_layers=1, cold_pages=True, cold_format="int4",
                          sub_page_size=2, int8_layers=(0,))
    report = export_model(src, pkg, config, quiet=True)
    return pkg, json.loads((pkg / "tinyserve.json").read_text()), report


def test_int8_layers_get_int8_inputs_and_overload(int4_mixed):
    pkg, manifest, report = int4_mixed
    tier = manifest["cold_tier"]
    assert tier["int8_layers"] == [0] and tier["int8_layers_source"] == "from --int8-layers"
    assert report.int8_layers == (0,) and manifest["num_layers"] >= 2
    v = manifest["validation"]
    assert v["max_abs_logit_diff"] <= v["tolerance"] and "INT4 (INT8 LAYERS 0)" in v["pages"]
    from tinyserve_trt.ops.node import node_attributes

    for path in (pkg / "model.onnx", pkg / "model.ort.onnx"):
        model = onnx.load(str(path), load_external_data=False)
        ops = {n.name: n for n in model.graph.node if n.op_type == schema.OP_TYPE}
        if path.name == "model.onnx":  # both function bodies are in the portable model
            assert {schema.overload_cold_format(f.overload) for f in model.functions} == {"int8", "int4"}
            assert {f.overload for f in model.functions} == {n.overload for n in ops.values()}
        inputs = {i.name: i for i in model.graph.input}
        for i, layer in enumerate(manifest["io"]["layers"]):
            fmt = "int8" if i == 0 else "int4"
            if ops:
                node = ops[f"tinyserve_attention_{i}"]
                assert node_attributes(node).cold_format == schema.overload_cold_format(node.overload) == fmt
            elem = [inputs[layer[r]].type.tensor_type.elem_type for r in schema.COLD_INPUTS]
            T = onnx.TensorProto
            assert elem == ([T.INT8, T.INT8, T.FLOAT, T.FLOAT] if fmt == "int8" else
                            [T.UINT8, T.UINT8, T.FLOAT16, T.FLOAT16]), (path.name, i)
            d = manifest["head_dim"]
            assert _dims(inputs[layer["key_cache_int8"]])[-1] == (d if fmt == "int8" else d // 2)


def test_each_exported_layer_reads_the_pool_in_its_own_codec(int4_mixed, rng):
    """A tiered pool built as the runtime builds it from this manifest (per-layer codecs), pages
    demoted: each layer's exported node (its attributes and overload, run by ORT) equals the numpy
    reference over that layer's pool inputs; and the engine runs the package with the pool checked
    after every step (pages really go cold, in both formats)."""
    onnxruntime = pytest.importorskip("onnxruntime")
    import numpy as np

    from tests.runtime.test_mixed_precision import PROMPTS, run_checked
    from tinyserve_trt import LLM, SamplingParams
    from tinyserve_trt.ops import sparse_attention_ref
    from tinyserve_trt.ops.node import make_op_model, node_attributes

    pkg, manifest, _ = int4_mixed
    llm = LLM(pkg, max_batch=4, hot_fraction=0.25)
    _, most_cold = run_checked(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert most_cold > 0
    pool = llm.engine.pool
    assert [pool.storage.layer_codec(i).cold_format for i in range(manifest["num_layers"])] == \
        ["int8"] + ["int4"] * (manifest["num_layers"] - 1)
    stats = llm.stats()
    assert stats["int8_layers"] == [0] and stats["cold_formats"] == "int4 (int8 layers 0)"

    ps, H, D = manifest["page_size"], manifest["num_kv_heads"], manifest["head_dim"]
    lens = (14, 9)
    seqs = [pool.allocate(-(-n // ps)) for n in lens]
    for seq, n in zip(seqs, lens):
        for j, p in enumerate(seq):
            k = rng.standard_normal((manifest["num_layers"], min(ps, n - j * ps), H, D)).astype(pool.k_pages(0).dtype)
            slots = p * ps + np.arange(k.shape[1])
            for layer in range(manifest["num_layers"]):
                pool.write_tokens(layer, slots, k[layer] * (1 + layer), -k[layer])
    for p in (seqs[0][0], seqs[0][2], seqs[1][1]):
        pool.demote(p)
    pool.check_integrity(check_data=True)
    table = np.array([seq + [seq[0]] * (4 - len(seq)) for seq in seqs])
    dtype = manifest["dtype"]
    common = dict(page_table=pool.physical_table(table), past_lens=np.array(lens, np.int32),
                  token_budget=np.array([8, 0], np.int32),
                  query=rng.standard_normal((2, manifest["num_heads"], 1, D)).astype(dtype),
                  key=rng.standard_normal((2, H, 1, D)).astype(dtype),
                  value=rng.standard_normal((2, H, 1, D)).astype(dtype))
    model = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    nodes = {n.name: n for n in model.graph.node if n.op_type == schema.OP_TYPE}
    for i in range(manifest["num_layers"]):
        attrs = node_attributes(nodes[f"tinyserve_attention_{i}"])
        feeds = dict(common, **pool.cache_inputs(i))
        ref, _ = sparse_attention_ref(**feeds, attrs=attrs)
        op = make_op_model(dtype, attrs, cold_pages=True, cold_format=attrs.cold_format)
        sess = onnxruntime.InferenceSession(op.SerializeToString(), providers=["CPUExecutionProvider"])
        out, _ = sess.run(None, {n: feeds[n] for n in schema.node_input_names(True, attrs.two_level) if n})
        np.testing.assert_allclose(out, ref, **schema.TOLERANCES[dtype])


@pytest.mark.parametrize("flags, message", [
    (("--cold-pages", "int4", "--int8-layers", "99"), "int8 layers [99] out of range: the model has 2 layers"),
    (("--cold-pages", "int4", "--int8-layers", "0,x"), "--int8-layers must be auto, dense, none or comma-separated"),
    (("--cold-pages", "int4", "--int8-layers", "1,1"), "int8_layers has duplicates"),
    (("--cold-pages", "int8", "--int8-layers", "0"), "int8 layers apply to int4 cold pages only"),
    (("--int8-layers", "0"), "int8 layers need a cold tier"),
])
def test_bad_int8_layers_exit_2(capsys, tmp_path, llama, flags, message):
    assert llama[2]["num_layers"] == 2
    code, line = _run(capsys, llama[0], "-o", tmp_path / "out", "-q", "--page-size", 4, "--no-validate", *flags)
    assert code == 2 and message in line, line
    assert not (tmp_path / "out").exists()
