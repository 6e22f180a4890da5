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


BATCH = (1, 8, 64)  # rows per step: (min, opt, max) of the engine's profile
NEW_TOKENS = (1, 1, 512)  # new tokens per row: decode-tuned, prefill chunks up to 512


def engine_profiles(manifest: dict, max_context: int) -> tuple[dict[str, tuple], dict]:
    """The (min, opt, max) shape of every dynamic input of the rewritten model, and the
    limits ``manifest["engine"]`` records for the runtime.

    TensorRT needs a range for every dynamic input, and inputs sharing an ONNX dim
    name (``batch``, ``num_pages``, ...) must get overlapping ranges. Page tables
    cover ``max_context``; the hot page pools (and key_min/key_max) hold up to twice
    what ``BATCH[2]`` sequences of ``max_context`` need - room for prefix-cached
    pages - and a cold tier as many INT8 pages again (its metadata rows are hot + cold).
    """
    from ..ops.quantization import scale_shape

    io, ps = manifest["io"], manifest["page_size"]
    hkv, d = manifest["num_kv_heads"], manifest["head_dim"]
    max_pages = -(-max_context // ps)
    batch, chunk = BATCH, NEW_TOKENS
    pool = (1, batch[1] * max_pages, 2 * batch[2] * max_pages)
    cold = manifest.get("cold_tier")
    rows = tuple(2 * n for n in pool) if cold else pool  # key_min/key_max: P (+ Pcold) rows
    inputs = io["inputs"]
    profiles = {inputs["input_ids"]: tuple((b, t) for b, t in zip(batch, chunk)),
                inputs["page_table"]: ((1, 1), (batch[1], max_pages // 2 or 1), (batch[2], max_pages))}
    if "position_ids" in inputs:
        profiles[inputs["position_ids"]] = profiles[inputs["input_ids"]]
    for role in ("past_lens", "token_budget", "logits_index"):
        if role in inputs:
            profiles[inputs[role]] = tuple((b,) for b in batch)
    for names in io["layers"]:
        for role in ("key_cache", "value_cache"):
            profiles[names[role]] = tuple((n, hkv, ps, d) for n in pool)
        for role in ("key_min", "key_max"):
            profiles[names[role]] = tuple((n, hkv, d) for n in rows)
        if cold:
            for role in ("key_cache_int8", "value_cache_int8"):
                profiles[names[role]] = tuple((n, hkv, ps, d) for n in pool)
            for role, gran in (("key_scale", cold["k_granularity"]), ("value_scale", cold["v_granularity"])):
                profiles[names[role]] = tuple((n, *scale_shape(gran, hkv, ps, d)) for n in pool)
    limits = dict(max_batch=batch[2], max_new_tokens=chunk[2], max_pages=max_pages, max_pool_pages=pool[2],
                  max_cold_pages=pool[2] if cold else 0)
    return profiles, limits


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
