"""tinyserve-trt: query-aware sparse attention over a paged KV cache for ONNX decoder LLMs.

Heavy dependencies (torch, tensorrt, cuda) are imported lazily by the parts
that need them, so ``import tinyserve_trt`` works on a bare CPU machine.
"""

__version__ = "0.1.0"
