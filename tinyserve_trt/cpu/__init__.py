"""Native CPU kernels of the op, loaded into ONNX Runtime as custom ops (``native.py``).

``csrc/`` holds the C++ sources, compiled on first use with the host compiler.
Imports nothing heavy: ``available()`` and ``register(session_options)`` are the API.
"""

from .native import DOMAIN, OP_TYPE, NativeUnavailable, available, library_path, register

__all__ = ["DOMAIN", "OP_TYPE", "NativeUnavailable", "available", "library_path", "register"]
