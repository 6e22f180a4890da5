"""Tiny random decoder LLMs exported to ONNX with KV-cache I/O, and their packages.

Built by the tests themselves (no downloads): a seeded random model from
``tinyserve_dev.models.tiny_models``, exported with KV-cache I/O by
``torch_export`` (legacy exporter), a byte-level tokenizer, then
``export_model`` into a package.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

VOCAB = 256


def export_source(arch: str, outdir: Path, seed: int = 0, edit=None) -> Path:
    """Write ``outdir/model.onnx`` (+ config.json, byte tokenizer) of a random tiny ``arch`` model,
    built and exported by the package's own fixture sources (legacy exporter, eager attention).
    ``edit``: called with the torch model (under ``no_grad``) before the export."""
    from tinyserve_dev.models.tiny_models import TinyModelConfig, build_tiny_model
    from tinyserve_trt.export.hf.torch_export import export_causal_lm

    model = build_tiny_model(TinyModelConfig(kind=arch, vocab_size=VOCAB, max_positions=512, seed=seed),
                             attn_implementation="eager")
    if edit is not None:
        import torch

        with torch.no_grad():
            edit(model)
    outdir.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer / deprecation chatter of the exporters
        path = export_causal_lm(model, outdir / "model.onnx", "legacy_eager")
    (outdir / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    write_byte_tokenizer(outdir)
    return path


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def write_byte_tokenizer(outdir: Path) -> None:
    """A byte-level tokenizer whose 256 tokens are the bytes (id = rank in the ByteLevel
    alphabet), plus a minimal chat template - enough to test text in and out."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(outdir / "tokenizer.json"))
    (outdir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))


def original_greedy(source: Path, source_io: dict, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy ids from the ORIGINAL export in ONNX Runtime, with its own past/present cache."""
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in sess.get_inputs()}
    types = {i.name: np.float16 if i.type == "tensor(float16)" else np.float32 for i in sess.get_inputs()}
    past = {n: np.zeros((1, shapes[n][1], 0, shapes[n][3]), types[n]) for n in source_io["past_inputs"]}
    names = [o.name for o in sess.get_outputs()]
    out, cur, pos = [], list(prompt), 0
    for _ in range(max_tokens):
        feeds = {source_io["input_ids"]: np.asarray([cur], np.int64), **past}
        if source_io.get("attention_mask"):
            feeds[source_io["attention_mask"]] = np.ones((1, pos + len(cur)), np.int64)
        if source_io.get("position_ids"):
            feeds[source_io["position_ids"]] = np.arange(pos, pos + len(cur), dtype=np.int64)[None]
        res = dict(zip(names, sess.run(None, feeds)))
        token = int(np.argmax(res[source_io["logits"]][0, -1]))
        out.append(token)
        past = {p: res[o] for p, o in zip(source_io["past_inputs"], source_io["present_outputs"])}
        pos += len(cur)
        cur = [token]
    return out


def build_package(arch: str, root: Path, **export_kwargs) -> tuple[Path, Path]:
    """(source model.onnx, package dir) for a tiny ``arch`` model under ``root``."""
    from tinyserve_trt.export.config import ExportConfig
    from tinyserve_trt.export.pipeline import export_model

    src = export_source(arch, root / f"{arch}-src")
    pkg = root / f"{arch}-pkg"
    cfg = dict(page_size=4, token_budget=16, dense_layers=1)
    cfg.update(export_kwargs)
    export_model(src, pkg, ExportConfig(**cfg), quiet=True)
    return src, pkg


def write_calibration(path: Path, manifest: dict, hot_fraction: float = 0.5, **fields) -> Path:
    """A calibration artifact shaped for the package ``manifest`` describes (random ranges:
    the runtime uses dynamic scales), as ``tinyserve-calibrate`` would write it."""
    import numpy as np

    from tinyserve_trt.contracts.calibration import CalibrationArtifact

    rng = np.random.default_rng(0)
    L, hkv, d = manifest["num_layers"], manifest["num_kv_heads"], manifest["head_dim"]
    kw = dict(model="tiny", page_size=manifest["page_size"], k_granularity="channel", v_granularity="token",
              hot_fraction=hot_fraction, k_absmax=rng.random((L, hkv, d)).astype(np.float32),
              v_absmax=rng.random((L, hkv)).astype(np.float32), sink_pages=1, recent_pages=2,
              token_budget=manifest["token_budget"], num_prompts=4)
    kw.update(fields)
    return CalibrationArtifact(**kw).save(path)


def build_cold_package(source: Path, manifest: dict, root: Path, cold_format: str = "int8",
                       **calibration_fields) -> Path:
    """The package of ``source`` (exported as :func:`build_package` does) with a cold tier of
    ``cold_format`` from a tiny calibration artifact."""
    from tinyserve_trt.export.config import ExportConfig
    from tinyserve_trt.export.pipeline import export_model

    cal = write_calibration(root / "calibration.json", manifest, **calibration_fields)
    pkg = root / ("cold-pkg" if cold_format == "int8" else f"cold-pkg-{cold_format}")
    export_model(source, pkg, ExportConfig(page_size=manifest["page_size"], token_budget=manifest["token_budget"],
                                           dense_layers=manifest["dense_layers"], calibration=str(cal),
                                           cold_format=cold_format), quiet=True)
    return pkg
