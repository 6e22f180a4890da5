"""Tiny real models whose attention the op does not implement (built with
transformers, exported with the legacy exporter: ~1 s each)."""

from __future__ import annotations

from pathlib import Path

COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=8192)


def build(kind: str):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if kind == "softcap":  # Gemma 2: tanh soft-capping of attention logits
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(head_dim=8, attn_logit_softcapping=50.0,
                                                    final_logit_softcapping=None, **COMMON)).eval()
    if kind == "sliding_window":  # Mistral with a window shorter than the context
        return tf.MistralForCausalLM(tf.MistralConfig(sliding_window=8, **COMMON)).eval()
    if kind == "alibi":  # BLOOM: ALiBi position bias added to the logits
        return tf.BloomForCausalLM(tf.BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4)).eval()
    raise ValueError(kind)


def export(kind: str, out_dir: Path) -> Path:
    from tinyserve_trt.export.hf.torch_export import export_causal_lm

    return export_causal_lm(build(kind), Path(out_dir) / "model.onnx", "legacy_eager")
