"""tinyserve-trt: query-aware sparse attention over a paged KV cache for ONNX decoder LLMs.

Heavy dependencies (torch, tensorrt, cuda, onnxruntime) are imported lazily by the
parts that need them, so ``import tinyserve_trt`` works on a bare CPU machine.
``LLM``, ``AsyncLLM`` and ``SamplingParams`` load on first access.
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "tinyserve_trt.runtime.llm",
    "AsyncLLM": "tinyserve_trt.runtime.async_llm",
    "SamplingParams": "tinyserve_trt.runtime.sampling",
}


def __getattr__(name):
    if name in _LAZY:
        from importlib import import_module

        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tinyserve_trt' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


__all__ = ["AsyncLLM", "LLM", "SamplingParams", "__version__"]
