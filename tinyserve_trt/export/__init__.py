"""tinyserve-export: rewrite a decoder LLM's ONNX export into the paged sparse op.

``pipeline.export_model`` is the entry point; ``cli.main`` the command line.
"""
