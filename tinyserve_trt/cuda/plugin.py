"""The tensorrt module with the tinyserve plugin library loaded - or one line saying what is missing.

Shared by the exporter (``export.trt_build`` builds engines) and the runtime
(``runtime.backends.trt`` runs them), so it lives below both. TensorRT imports
the op node as the ``tinyserve::QueryAwareSparseAttention`` plugin, so the
plugin library must be loaded (RTLD_GLOBAL) before a model is parsed or an
engine deserialized. Nothing is imported until :func:`require_tensorrt` runs.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

PLUGIN_ENV = "TINYSERVE_TRT_PLUGIN"  # an override (one file); tinyserve-build-plugin's output is found without it
PLUGIN_DEFAULT = Path(__file__).resolve().parents[2] / "build" / "plugins" / "libtinyserve_trt_plugin.so"


class TensorRTUnavailable(RuntimeError):
    """A missing piece of the TensorRT path: the module, the plugin library, cuda-python or a GPU."""


def plugin_library(plugin_dir: str | os.PathLike | None = None) -> Path:
    """The plugin library: in ``plugin_dir`` (``EngineConfig.plugin_dir``, tinyserve-build-plugin's ``-o``)
    when given, else ``$TINYSERVE_TRT_PLUGIN``, else where ``tinyserve-build-plugin`` builds by default,
    else a checkout's ``build/plugins/`` (``plugin_build.find_library``); TensorRTUnavailable (one line) if absent."""
    from .plugin_build import PLUGIN_LIBRARY, find_library

    try:
        return find_library(PLUGIN_LIBRARY, plugin_dir, PLUGIN_ENV)
    except FileNotFoundError as e:
        raise TensorRTUnavailable(f"TensorRT plugin library not found: {e}") from None


def require_tensorrt(plugin_dir: str | os.PathLike | None = None):
    """The tensorrt module, with the plugin library (:func:`plugin_library`) loaded and a GPU present."""
    try:
        import tensorrt as trt
    except Exception:  # ImportError, or a placeholder wheel that fails on import
        raise TensorRTUnavailable("TensorRT is not installed (pip install 'tinyserve-trt[trt]' on a machine with "
                                  "TensorRT >= 10 libraries)") from None
    lib = plugin_library(plugin_dir)
    try:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise TensorRTUnavailable(f"cannot load the TensorRT plugin library {lib}: {e}") from None
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python
        except ImportError:
            raise TensorRTUnavailable("cuda-python is not installed (pip install 'tinyserve-trt[gpu]')") from None
    err, count = cudart.cudaGetDeviceCount()
    if int(err) != 0 or count < 1:
        raise TensorRTUnavailable("no CUDA GPU is visible; TensorRT engines are built on the GPU they run on")
    return trt
