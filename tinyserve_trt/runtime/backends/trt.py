"""TrtBackend: TensorRT engine with the QueryAwareSparseAttention plugin - issue #5.

Registered as ``trt`` in ``backends/__init__.py``; implemented by issue #5.
"""

from __future__ import annotations

from tinyserve_trt.runtime.backends.base import Backend


class TrtBackend(Backend):
    name = "trt"

    def __init__(self, package, pool, **options):
        raise RuntimeError("the TensorRT backend is not implemented yet (issue #5); use backend='ort'")

    def run(self, batch):  # pragma: no cover - never constructed
        raise NotImplementedError
