"""Tiny random decoder LLMs exported to ONNX with KV-cache I/O, and their packages.

Built by the tests themselves (no downloads): a random ``transformers`` model,
``torch.onnx.export(dynamo=False)`` through a wrapper with flat inputs
``input_ids, attention_mask, position_ids, past_key_values.{i}.key/value`` and
outputs ``logits, present.{i}.key/value``, then ``export_model`` into a package.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

VOCAB = 256


def _config(arch: str):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if arch == "llama":
        return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    if arch == "qwen2":
        return transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                      bos_token_id=1, eos_token_id=2)
        return cfg, transformers.GPT2LMHeadModel
    raise ValueError(f"unknown tiny arch {arch!r}")


def export_source(arch: str, outdir: Path, seed: int = 0) -> Path:
    """Write ``outdir/model.onnx`` (+ config.json) of a random tiny ``arch`` model."""
    import torch
    from transformers import DynamicCache

    torch.manual_seed(seed)
    cfg, cls = _config(arch)
    cfg._attn_implementation = "eager"
    model = cls(cfg).eval()
    layers = cfg.num_hidden_layers
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = cfg.hidden_size // cfg.num_attention_heads

    class Flat(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache([(past[2 * i], past[2 * i + 1]) for i in range(layers)])
            out = self.m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
            pkv = out.past_key_values
            presents = []
            for i in range(layers):
                layer = pkv.layers[i]
                presents += [layer.keys, layer.values]
            return (out.logits, *presents)

    b, p, s = 2, 3, 4
    ids = torch.randint(0, VOCAB, (b, s))
    mask = torch.ones(b, p + s, dtype=torch.int64)
    pos = torch.arange(p, p + s).repeat(b, 1)
    past = [torch.randn(b, kv_heads, p, head_dim) for _ in range(2 * layers)]
    past_names = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    present_names = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total"},
            "position_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}}
    axes.update({n: {0: "batch", 2: "past"} for n in past_names})
    axes.update({n: {0: "batch", 2: "total"} for n in present_names})
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / "model.onnx"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer / deprecation chatter of the exporters
        torch.onnx.export(Flat(model), (ids, mask, pos, *past), str(path), dynamo=False, opset_version=17,
                          input_names=["input_ids", "attention_mask", "position_ids", *past_names],
                          output_names=["logits", *present_names], dynamic_axes=axes)
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
    past = {n: np.zeros((1, shapes[n][1], 0, shapes[n][3]), np.float32) for n in source_io["past_inputs"]}
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
