"""Every exporter style of every tiny model is rewritten into the op and
reproduces the original (structure and numerics)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from tinyserve_trt.export.config import ExportConfig
from tinyserve_trt.export.pipeline import export_model
from tinyserve_trt.ops import schema

KINDS = ("gpt2", "llama", "qwen2")
STYLES = ("dynamo20", "dynamo23", "legacy_eager", "legacy_sdpa")
EXPECTED_RULE = {"dynamo20": "sdpa", "dynamo23": "onnx_attention", "legacy_eager": "eager", "legacy_sdpa": "sdpa"}
CONFIG = ExportConfig(page_size=4, dense_layers=0)  # small pages: several per sequence in validation


def check_package(out, layers: int, heads: int, kv_heads: int):
    model = onnx.load(str(out / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    ops = [n for n in model.graph.node if n.op_type == schema.OP_TYPE and n.domain == schema.DOMAIN]
    assert len(ops) == layers
    assert {a.name for a in ops[0].attribute} >= {"plugin_namespace", "policy", "scale"}
    names = {i.name for i in model.graph.input}
    assert not any("past_key_values" in n for n in names) and "attention_mask" not in names
    assert {"page_table", "past_lens", "token_budget"} <= names
    assert not any(o.name.startswith("present") for o in model.graph.output)
    assert not any(n.op_type in ("Softmax", "Attention") for n in model.graph.node), "old attention left behind"
    manifest = json.loads((out / "tinyserve.json").read_text())
    assert (manifest["num_layers"], manifest["num_heads"], manifest["num_kv_heads"]) == (layers, heads, kv_heads)
    assert len(manifest["io"]["layers"]) == layers and manifest["source"]["sha256"]
    return manifest


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("kind", KINDS)
def test_rewrite_and_validate(export_fixture, tmp_path, kind, style):
    src = export_fixture(kind, style)
    report = export_model(src / "model.onnx", tmp_path / "pkg", CONFIG, quiet=True)
    assert dict(report.rule_counts) == {EXPECTED_RULE[style]: 2}
    assert report.validation is not None and report.validation <= 1e-4
    kv = 4 if kind == "gpt2" else 2
    manifest = check_package(tmp_path / "pkg", 2, 4, kv)
    assert manifest["validation"]["max_abs_logit_diff"] == report.validation


def test_optimum_export(optimum_fixture_dir, tmp_path):
    """optimum's GPT-2 computes its scale from shapes at run time."""
    report = export_model(optimum_fixture_dir / "model.onnx", tmp_path / "pkg", CONFIG, quiet=True)
    assert dict(report.rule_counts) == {"sdpa": 2} and report.validation <= 1e-4
    manifest = check_package(tmp_path / "pkg", 2, 4, 4)
    assert manifest["io"]["inputs"]["input_ids"] == "input_ids"  # not the position-embedding input
    assert (tmp_path / "pkg" / "config.json").is_file()  # files next to the model are copied


def test_dense_layers_and_scale(export_fixture, tmp_path):
    src = export_fixture("llama", "legacy_eager")
    config = ExportConfig(page_size=4, dense_layers=1)
    export_model(src / "model.onnx", tmp_path / "pkg", config, quiet=True)
    model = onnx.load(str(tmp_path / "pkg" / "model.onnx"))
    ops = [n for n in model.graph.node if n.op_type == schema.OP_TYPE]
    policies = [onnx.helper.get_attribute_value(next(a for a in n.attribute if a.name == "policy")) for n in ops]
    assert policies == [b"dense", b"query_aware"]
    # the sparse layer selects per query head by default (the ort backend's), the dense one cannot
    sparse = schema.OpAttributes(group_reduce=config.resolved_group_reduce).function_overload()
    assert config.resolved_group_reduce == "head" and sorted(f.overload for f in model.functions) == ["dense", sparse]
    scales = [onnx.helper.get_attribute_value(next(a for a in n.attribute if a.name == "scale")) for n in ops]
    assert scales == [0.0, 0.0]  # 1/sqrt(16) found in the graph is the op's default


def test_dense_layer_indices(export_fixture, tmp_path):
    """--dense-layers as indices: the named layer is dense, a leading one is not (the count form
    could not say that), and the manifest keeps the list for calibration and the harness."""
    src = export_fixture("llama", "legacy_eager")
    export_model(src / "model.onnx", tmp_path / "pkg", ExportConfig(page_size=4, dense_layers=(1,)), quiet=True)
    model = onnx.load(str(tmp_path / "pkg" / "model.onnx"))
    ops = [n for n in model.graph.node if n.op_type == schema.OP_TYPE]
    policies = [onnx.helper.get_attribute_value(next(a for a in n.attribute if a.name == "policy")) for n in ops]
    assert policies == [b"query_aware", b"dense"]
    manifest = json.loads((tmp_path / "pkg" / "tinyserve.json").read_text())
    assert manifest["dense_layers"] == [1]


def test_dense_layer_past_the_model_is_input_error(export_fixture, tmp_path):
    from tinyserve_trt.export.errors import InputError

    src = export_fixture("llama", "legacy_eager")
    with pytest.raises(InputError, match=r"dense_layers \[5\] out of range: the model has 2 layers"):
        export_model(src / "model.onnx", tmp_path / "pkg", ExportConfig(page_size=4, dense_layers=(0, 5)), quiet=True)
    assert not (tmp_path / "pkg").exists()


def test_sparse_budget_changes_logits(export_fixture, tmp_path):
    """The rewritten model really selects pages: a small budget on long prompts moves the logits."""
    import onnxruntime as ort

    from tinyserve_trt.export.validate import validate

    src = export_fixture("llama", "legacy_sdpa")
    export_model(src / "model.onnx", tmp_path / "pkg", CONFIG, quiet=True)
    manifest = json.loads((tmp_path / "pkg" / "tinyserve.json").read_text())
    orig = ort.InferenceSession(str(src / "model.onnx"))
    new = ort.InferenceSession(str(tmp_path / "pkg" / "model.onnx"))
    dense = validate(orig, new, manifest, lengths=(40, 33), decode_steps=3, budget=0).max_abs_diff
    sparse = validate(orig, new, manifest, lengths=(40, 33), decode_steps=3, budget=8).max_abs_diff
    assert dense <= 1e-4 < sparse and np.isfinite(sparse)


def test_fp16_pages(export_fixture, tmp_path):
    """--fp16: page pools and new K/V in fp16, the rest of the model fp32."""
    src = export_fixture("qwen2", "dynamo20")
    report = export_model(src / "model.onnx", tmp_path / "pkg", ExportConfig(page_size=4, dense_layers=0, fp16=True),
                          quiet=True)
    assert 0 < report.validation <= 5e-2
    model = onnx.load(str(tmp_path / "pkg" / "model.onnx"))
    types = {i.name: i.type.tensor_type.elem_type for i in list(model.graph.input) + list(model.graph.output)}
    assert types["key_cache.0"] == types["key_min.1"] == types["new_value.1"] == onnx.TensorProto.FLOAT16
    assert types["logits"] == onnx.TensorProto.FLOAT
