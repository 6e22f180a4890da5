"""``tinyserve-export <HF folder>`` and ``<model.gguf>`` convert through torch, then the usual pipeline (#30).

Before: a folder or a GGUF file was read as an ONNX file ("not a readable ONNX model").
"""

from __future__ import annotations

import json

import pytest

from tinyserve_trt.export.hf import convert

from .test_cli import one_line, run


def _hf_folder(root, kind: str):
    """A random tiny ``kind`` model saved the way users have it: save_pretrained + tokenizer files."""
    from tinyserve_dev.models.tiny_models import TinyModelConfig, build_tiny_model

    from ..tiny_models import write_byte_tokenizer

    model = build_tiny_model(TinyModelConfig(kind=kind, vocab_size=256, max_positions=512, seed=3))
    model.save_pretrained(str(root))
    write_byte_tokenizer(root)
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    (root / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return root


def test_source_kind(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "model.onnx").write_bytes(b"")
    assert convert.source_kind(tmp_path / "m.gguf") == "gguf"
    assert convert.source_kind(tmp_path / "hf") == "hf"
    assert convert.source_kind(tmp_path / "model.onnx") is None
    assert convert.source_kind(tmp_path) is None  # a folder without config.json


def test_hf_folder_exports_and_is_cached(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path / "cache"))
    src = _hf_folder(tmp_path / "qwen2-hf", "qwen2")
    got, out, err = run(capsys, src, "-o", tmp_path / "pkg")
    assert got == 0, err
    assert "converting" in err and "validation max |logit diff|" in out
    manifest = json.loads((tmp_path / "pkg" / "tinyserve.json").read_text())
    assert manifest["num_layers"] == 2 and manifest["vocab_size"] == 256
    assert (tmp_path / "pkg" / "tokenizer.json").is_file()
    got, _, err = run(capsys, src, "-o", tmp_path / "pkg2")  # second time: from the cache
    assert got == 0 and "converting" not in err


def test_unsupported_family_refused_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path / "cache"))
    src = _hf_folder(tmp_path / "gpt2-hf", "gpt2")
    capsys.readouterr()  # save_pretrained's progress bar
    got, _, err = run(capsys, src, "-o", tmp_path / "pkg", "-q")
    assert got == 2 and "'gpt2' is not one of the families" in one_line(err)
    assert not (tmp_path / "pkg").exists()


def test_bad_gguf_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf at all")
    got, _, err = run(capsys, tmp_path / "broken.gguf", "-o", tmp_path / "pkg", "-q")
    assert got == 2 and one_line(err)
    assert not (tmp_path / "pkg").exists()


@pytest.mark.slow
def test_smollm2_gguf_through_the_generic_path(capsys, tmp_path):
    """The demo's GGUF given as a file: the generic converter, not --demo's code, exports it."""
    from tinyserve_trt.export.hf.smollm2 import find_gguf

    got, out, err = run(capsys, find_gguf(), "-o", tmp_path / "pkg", "--no-native-decode")
    assert got == 0, err
    assert json.loads((tmp_path / "pkg" / "tinyserve.json").read_text())["num_layers"] == 30
