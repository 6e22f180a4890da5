"""Test models: seeded tiny GPT-2 / LLaMA-GQA / Qwen2 (``tiny_models``; its CLI
writes the fixture matrix), exporter parity runs (``parity``) and one-block
graph reports for docs/export_patterns.md (``graph_report``)."""
