"""Tiny random-weight Hugging Face causal LMs, built deterministically.

These are the source models the export fixtures are generated from: small
enough (vocab 256, 2 layers, hidden 64) that a full exporter-style matrix is
written in seconds, yet each keeps the feature the rewrite rules must see:

- ``gpt2``:  fused QKV ``Conv1D`` (Gemm + Split), learned positions, MHA.
- ``llama``: separate q/k/v projections, rotary embeddings, GQA (4 q / 2 kv).
- ``qwen2``: LLaMA layout plus q/k/v bias Adds.

Weights come from ``torch.manual_seed(seed)`` before construction, so two
calls with the same seed give bit-identical models. torch and transformers
are imported inside the functions: importing this module costs nothing.

Run ``python -m tinyserve_dev.models.tiny_models --out DIR`` to write
every model x exporter style (see ``torch_export.EXPORT_STYLES``).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

MODEL_KINDS = ("gpt2", "llama", "qwen2")


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of a tiny decoder. ``num_kv_heads`` < ``num_heads`` means GQA
    (ignored for GPT-2, which is always MHA)."""

    kind: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_positions: int = 256
    rope_theta: float = 10000.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"kind must be one of {MODEL_KINDS}, got {self.kind!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        for name in ("vocab_size", "num_layers", "intermediate_size", "max_positions"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        """KV heads the exported cache actually has (GPT-2 has no GQA)."""
        return self.num_heads if self.kind == "gpt2" else self.num_kv_heads


def hf_config(cfg: TinyModelConfig):
    """The transformers config object for ``cfg`` (no weights)."""
    import transformers

    if cfg.kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.max_positions,
            n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers,
            n_head=cfg.num_heads,
            n_inner=cfg.intermediate_size,
            bos_token_id=0,
            eos_token_id=1,
            # Dropout off so eager and exported graphs agree exactly.
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    if cfg.kind == "llama":
        return transformers.LlamaConfig(**common)
    # Qwen2 always has q/k/v bias; sliding window off to keep one mask kind.
    return transformers.Qwen2Config(**common, use_sliding_window=False)


def build_tiny_model(cfg: TinyModelConfig | str, attn_implementation: str = "eager"):
    """A seeded random-weight ``*ForCausalLM`` in eval mode, fp32.

    ``attn_implementation`` is "eager" or "sdpa"; it decides which attention
    pattern the exporter traces. Biases are randomised too (HF initialises
    them to zero), so a bias Add can never be folded away unnoticed.
    """
    import torch
    import transformers

    if isinstance(cfg, str):
        cfg = TinyModelConfig(kind=cfg)
    if attn_implementation not in ("eager", "sdpa"):
        raise ValueError(f"attn_implementation must be 'eager' or 'sdpa', got {attn_implementation!r}")
    config = hf_config(cfg)
    config._attn_implementation = attn_implementation
    torch.manual_seed(cfg.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    from tinyserve_trt.export.hf import torch_export

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write <kind>/<style>/model.onnx")
    parser.add_argument("--kinds", nargs="+", default=list(MODEL_KINDS), choices=MODEL_KINDS)
    parser.add_argument("--styles", nargs="+", default=list(torch_export.EXPORT_STYLES),
                        choices=list(torch_export.EXPORT_STYLES))
    args = parser.parse_args(argv)
    total = time.perf_counter()
    for kind in args.kinds:
        for style in args.styles:
            t0 = time.perf_counter()
            path = export_tiny(kind, style, args.out / kind / style)
            print(f"{kind:6s} {style:13s} {time.perf_counter() - t0:6.1f} s  {path}")
    print(f"total {time.perf_counter() - total:.1f} s")
    return 0


def export_tiny(kind: str, style, out_dir: str | Path) -> Path:
    """Build the seeded tiny ``kind`` model and export it in ``style`` to
    ``out_dir/model.onnx``; also writes ``config.json`` (the HF config) and
    ``fixture.json`` (kind, style, seed) so a test can rebuild the torch twin."""
    from tinyserve_trt.export.hf.torch_export import export_causal_lm, get_style

    style = get_style(style)
    cfg = TinyModelConfig(kind=kind)
    model = build_tiny_model(cfg, attn_implementation=style.attn_implementation)
    out_dir = Path(out_dir)
    path = export_causal_lm(model, out_dir / "model.onnx", style)
    model.config.to_json_file(str(out_dir / "config.json"))
    meta = {"kind": kind, "style": style.name, "opset": style.opset, "dynamo": style.dynamo,
            "attn_implementation": style.attn_implementation, "seed": cfg.seed}
    (out_dir / "fixture.json").write_text(json.dumps(meta, indent=2) + "\n")
    return path


if __name__ == "__main__":
    raise SystemExit(main())

