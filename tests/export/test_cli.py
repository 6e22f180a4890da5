"""tinyserve-export's command line: exit codes, one-line errors, no partial output."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tinyserve_trt.export import checks, cli


def run(capsys, *argv):
    code = cli.main([*map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def no_cache_model(path):
    """An 'encoder': token ids -> embedding -> self-attention-free output, no past/present."""
    emb = helper.make_tensor("emb", TensorProto.FLOAT, [16, 4], np.ones(64, np.float32).tolist())
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["h"]), helper.make_node("Softmax", ["h"], ["out"])]
    g = helper.make_graph(nodes, "enc", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", "s", 4])], [emb])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def cache_without_attention(path):
    """KV-cache I/O whose cache feeds no attention (a Concat and a ReduceMean)."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Concat", ["past", "new"], ["present"], axis=-2),
             helper.make_node("ReduceMean", ["present"], ["logits"], keepdims=0, axes=[1])]
    g = helper.make_graph(nodes, "nocore", [helper.make_tensor_value_info("past", f, ["b", 2, "p", 4]),
                                            helper.make_tensor_value_info("new", f, ["b", 2, "s", 4])],
                          [helper.make_tensor_value_info("logits", f, ["b", "t", 4]),
                           helper.make_tensor_value_info("present", f, ["b", 2, "t", 4])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--page-size", "--token-budget", "--dense-layers", "--fp16", "--no-validate", "--backend", "--demo",
                "auto", "Exit codes"):
        assert opt in text


def test_policy_choices_are_the_registry_selecting_policies(capsys):
    from tinyserve_trt.ops import policies

    action = next(a for a in cli.parser()._actions if a.dest == "policy")
    assert tuple(action.choices) == policies.selecting() and "dense" not in action.choices
    assert set(policies.selecting()) | {"dense"} == set(policies.registered())
    with pytest.raises(SystemExit) as e:
        cli.main(["x.onnx", "--policy", "dense"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("make,code,message", [
    (lambda p: p / "missing.onnx", 2, "no such file"),
    (lambda p: (p / "x.onnx").write_text("not a model") and p / "x.onnx", 2, "not a readable ONNX model"),
    (lambda p: no_cache_model(p / "enc.onnx"), 2, "no KV-cache I/O"),
    (lambda p: cache_without_attention(p / "nocore.onnx"), 3, "no attention block found"),
])
def test_bad_inputs(capsys, tmp_path, make, code, message):
    src = make(tmp_path)
    got, _, err = run(capsys, src, "-o", tmp_path / "out", "-q")
    assert got == code and message in one_line(err)
    assert not (tmp_path / "out").exists()


def test_truncated_file(capsys, tmp_path, export_fixture):
    data = (export_fixture("llama", "legacy_eager") / "model.onnx").read_bytes()
    (tmp_path / "t.onnx").write_bytes(data[: len(data) // 2])
    got, _, err = run(capsys, tmp_path / "t.onnx", "-o", tmp_path / "out", "-q")
    assert got == 2 and "not a readable ONNX model" in one_line(err)


def test_unsupported_variant_exit_3(capsys, tmp_path):
    from .refused_models import export

    src = export("softcap", tmp_path / "src")
    got, _, err = run(capsys, src, "-o", tmp_path / "out", "-q")
    assert got == 3 and "soft-capping" in one_line(err)


def test_validation_failure_exit_4_leaves_nothing(capsys, tmp_path, export_fixture, monkeypatch):
    """A rewrite that computes something else (here: a wrong softmax scale) must fail validation."""
    monkeypatch.setattr(checks, "resolve_scale", lambda match, values: 0.5)
    src = export_fixture("llama", "legacy_sdpa") / "model.onnx"
    got, _, err = run(capsys, src, "-o", tmp_path / "out", "-q", "--dense-layers", "0")
    assert got == 4 and "max |logit diff|" in one_line(err)
    assert list(tmp_path.iterdir()) == []  # no OUTDIR, no temporary directory left


def test_trt_backend_without_tensorrt_exit_3(capsys, tmp_path, export_fixture):
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here")
    except Exception:
        pass
    src = export_fixture("llama", "legacy_eager") / "model.onnx"
    got, _, err = run(capsys, src, "-o", tmp_path / "out", "-q", "--backend", "trt")
    assert got == 3 and "TensorRT" in one_line(err)


def test_existing_output_needs_force(capsys, tmp_path, export_fixture):
    src = export_fixture("gpt2", "legacy_eager") / "model.onnx"
    (tmp_path / "out").mkdir()
    got, _, err = run(capsys, src, "-o", tmp_path / "out", "-q")
    assert got == 2 and "--force" in one_line(err)
    got, out, _ = run(capsys, src, "-o", tmp_path / "out", "-q", "--force", "--page-size", "auto")
    assert got == 0 and "validation max |logit diff|" in out


@pytest.mark.parametrize("ctx,page", [(1024, 8), (4096, 16), (16384, 32), (65536, 64), (1 << 20, 64)])
def test_auto_page_size(ctx, page):
    """Single level (``--sub-page-size 0``): auto sizes the page by the context. With the default
    two-level selection auto is the measured page size (tests/export/test_two_level.py)."""
    from tinyserve_trt.export.config import DEFAULT_PAGE_SIZE, ExportConfig

    assert ExportConfig(page_size="auto", max_context=ctx, sub_page_size=0).resolved_page_size() == page
    assert ExportConfig(page_size="auto", max_context=ctx).resolved_page_size() == DEFAULT_PAGE_SIZE


@pytest.mark.slow
def test_smollm2_demo_end_to_end(capsys, tmp_path):
    """The embedded default model, exported and validated as the README's first command does."""
    pytest.importorskip("transformers")
    got, out, err = run(capsys, "--demo", "-o", tmp_path / "smol", "-q")
    assert got == 0, err
    import json

    manifest = json.loads((tmp_path / "smol" / "tinyserve.json").read_text())
    assert (manifest["num_layers"], manifest["num_heads"], manifest["num_kv_heads"]) == (30, 9, 3)
    assert manifest["validation"]["max_abs_logit_diff"] <= 1e-4
    assert manifest["eos_token_id"] == 2 and manifest["model_name"] == "SmolLM2-135M-Instruct"
    for f in ("tokenizer.json", "tokenizer_config.json", "model.onnx", "model.onnx.data"):
        assert (tmp_path / "smol" / f).is_file(), f
