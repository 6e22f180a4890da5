"""Backends: ABC + registry + ``make_backend`` factory.

The registry maps a name to ``module:Class`` so a backend's heavy imports
(onnxruntime, tensorrt, cuda) happen only when that backend is made.
  ort  ONNX Runtime; its ``provider`` option picks the EP (cpu, cuda, tensorrt: ort_providers.py)
  trt  TensorRT with the QueryAwareSparseAttention plugin (issue #5)
"""

from __future__ import annotations

from importlib import import_module

from tinyserve_trt.runtime.backends.base import Backend, StepOutput

BACKENDS: dict[str, str] = {
    "ort": "tinyserve_trt.runtime.backends.ort:OrtBackend",
    "trt": "tinyserve_trt.runtime.backends.trt:TrtBackend",
}


def register_backend(name: str, target: str) -> None:
    """Register ``target`` (``"package.module:Class"``) under ``name``."""
    if ":" not in target:
        raise ValueError(f"backend target must be 'module:Class', got {target!r}")
    BACKENDS[name] = target


def make_backend(name: str, package, pool, **options) -> Backend:
    """The backend ``name`` running ``package`` (a ModelPackage) over ``pool`` (a PagePool).

    ``options`` go to the backend's constructor (ort: ``threads``, ``provider``, ``providers``).
    ValueError for an unknown name; ImportError / RuntimeError with a one-line
    reason when the backend's dependencies are missing.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose from {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    try:
        backend_cls = getattr(import_module(module), cls)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            raise RuntimeError(f"backend {name!r} is not available in this build ({module} is missing)") from None
        raise
    return backend_cls(package, pool, **options)


__all__ = ["BACKENDS", "Backend", "StepOutput", "make_backend", "register_backend"]
