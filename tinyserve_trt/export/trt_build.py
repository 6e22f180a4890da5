"""Build a TensorRT engine from a rewritten model, with the tinyserve plugin.

TensorRT imports the op node as the ``tinyserve::QueryAwareSparseAttention``
plugin (the node carries ``plugin_namespace``), so the plugin library must be
loaded before parsing (``cuda.plugin``). Every missing piece is a one-line
UnsupportedError (exit 3): no tensorrt module, no plugin library, no GPU.
"""

from __future__ import annotations

from pathlib import Path

from ..cuda import plugin
from .errors import UnsupportedError


def require_tensorrt():
    """``cuda.plugin.require_tensorrt``, its one-line refusal as an UnsupportedError (exit 3)."""
    try:
        return plugin.require_tensorrt()
    except plugin.TensorRTUnavailable as e:
        raise UnsupportedError(str(e)) from None


def build_engine(onnx_path: Path, plan_path: Path, profiles: dict[str, tuple], fp16: bool = True,
                 workspace_bytes: int = 1 << 30) -> Path:
    """Parse ``onnx_path`` and serialize an engine to ``plan_path``.

    ``profiles`` maps each dynamic input to its (min, opt, max) shapes - batch,
    new tokens and page-table width - in one optimization profile.
    """
    trt = require_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    trt.init_libnvinfer_plugins(logger, "")
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise UnsupportedError(f"TensorRT could not parse {onnx_path}: {errors[:300]}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profiles.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise UnsupportedError("TensorRT failed to build the engine (see the log above)")
    plan_path.write_bytes(bytes(serialized))
    return plan_path
