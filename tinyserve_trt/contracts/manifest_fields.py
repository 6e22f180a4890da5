"""Type and range checks of the manifest's fields (``manifest.Manifest`` calls them).

A manifest is untrusted input: each check raises :class:`PackageError` with one line naming
the field, so a malformed ``tinyserve.json`` never surfaces as a TypeError deep in the runtime.
The op's policies, its ``candidate_share`` range and its version come from ``ops.schema``.
"""

from __future__ import annotations

from tinyserve_trt.contracts.budget import DecodeBudget
from tinyserve_trt.contracts.package_paths import PackageError
from tinyserve_trt.contracts.dense_layers import dense_layer_indices
from tinyserve_trt.ops import schema

BACKENDS = ("ort", "trt")
ENGINE_LIMITS = ("max_batch", "max_new_tokens", "max_pages", "max_pool_pages")  # contracts.engine_profiles
MAX_ID = (1 << 31) - 1  # ids and sizes reach the model as int32 / int64: no bignums


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -MAX_ID <= value <= MAX_ID


def check_int(name: str, value, low: int = 0, high: int | None = None) -> None:
    """``value`` is an int in ``[low, high]`` (no bool, no float)."""
    if not is_int(value) or value < low or (high is not None and value > high):
        want = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise PackageError(f"{name} must be an int {want}, got {value!r}")


def check_optional(name: str, value, kind: type, what: str) -> None:
    if value is not None and not isinstance(value, kind):
        raise PackageError(f"{name} must be {what} or null, got {value!r}")


def check_token_ids(name: str, value, vocab_size) -> None:
    """``bos_token_id`` / ``eos_token_id``: null, a token id or a list of them, each in ``[0, vocab)``."""
    if value is None:
        return
    ids = value if isinstance(value, list) else [value]
    if not all(is_int(t) and t >= 0 for t in ids):
        raise PackageError(f"{name} must be a token id >= 0, a list of them or null, got {value!r}")
    if is_int(vocab_size) and any(t >= vocab_size for t in ids):
        raise PackageError(f"{name} {value!r} out of range for vocab_size {vocab_size}")


def check_names(where: str, names: dict, extra: dict | None = None) -> None:
    """Each value of ``names`` is a tensor name (a non-empty string); ``extra``: key -> choices
    for the non-name keys (a layer's ``policy``)."""
    for key, value in names.items():
        if extra and key in extra:
            if value not in extra[key]:
                raise PackageError(f"{where} {key} must be one of {extra[key]}, got {value!r}")
        elif not isinstance(value, str) or not value:
            raise PackageError(f"{where}[{key!r}] must be a tensor name (a string), got {value!r}")


def check_layer_io(i: int, layer: dict) -> None:
    check_names(f"io.layers[{i}]", layer, {"policy": schema.POLICIES})


def check_op(op) -> None:
    """The op the package's graph calls: ours, at a version this runtime implements (a newer
    package op is refused: its semantics may differ)."""
    if op is None:
        return
    if not isinstance(op, dict):
        raise PackageError(f"op must be an object with domain, name and version, got {op!r}")
    ident = (op.get("domain"), op.get("name"))
    if ident != (schema.DOMAIN, schema.OP_TYPE):
        raise PackageError(f"op is {ident[0]}::{ident[1]}, this tinyserve runs {schema.DOMAIN}::{schema.OP_TYPE}")
    version = op.get("version")
    if not is_int(version) or version < 1:
        raise PackageError(f"op.version must be a positive int, got {version!r}")
    if version > schema.VERSION:
        raise PackageError(f"op version {version} is newer than this tinyserve's ({schema.VERSION}); "
                           "upgrade tinyserve-trt")


def check_engine(engine) -> None:
    """``engine``: null or an object with ``file`` and the profile limits as ints."""
    if engine is None:
        return
    if not isinstance(engine, dict) or "file" not in engine:
        raise PackageError(f"engine must be null or an object with 'file', got {engine!r}")
    for key in ENGINE_LIMITS:
        if key in engine:
            check_int(f"engine.{key}", engine[key], 1)
    if "max_cold_pages" in engine:
        check_int("engine.max_cold_pages", engine["max_cold_pages"], 0)


def check_scalars(m) -> None:
    """The manifest's policy, layer counts, backend, two-level share and informational sections."""
    if m.policy not in schema.POLICIES:
        raise PackageError(f"policy must be one of {schema.POLICIES}, got {m.policy!r}")
    if isinstance(m.dense_layers, int) and not isinstance(m.dense_layers, bool):
        check_int("dense_layers", m.dense_layers, 0, m.num_layers)  # a count: the leading ones
    elif not isinstance(m.dense_layers, list):
        raise PackageError(f"dense_layers must be a count or a list of layer indices, got {m.dense_layers!r}")
    else:
        try:
            dense_layer_indices(m.dense_layers, m.num_layers)
        except ValueError as e:
            raise PackageError(str(e)) from None
    check_int("sink_pages", m.sink_pages, 0)
    check_int("recent_pages", m.recent_pages, 0)
    if m.backend not in BACKENDS:
        raise PackageError(f"backend must be one of {BACKENDS}, got {m.backend!r}")
    if m.candidate_share is not None:
        try:
            schema.attribute("candidate_share").validate(m.candidate_share)
        except ValueError as e:
            raise PackageError(f"candidate_share: {e}") from None
    if m.group_reduce not in schema.GROUP_REDUCTIONS:
        raise PackageError(f"group_reduce must be one of {schema.GROUP_REDUCTIONS}, got {m.group_reduce!r}")
    try:
        DecodeBudget(m.token_budget, m.budget_share)
    except ValueError as e:
        raise PackageError(str(e)) from None
    for name in ("source", "source_io", "validation"):
        check_optional(name, getattr(m, name), dict, "an object")
    check_optional("tool_version", m.tool_version, str, "a string")
    for name in ("bos_token_id", "eos_token_id"):
        check_token_ids(name, getattr(m, name), m.vocab_size)
    check_op(m.op)
    check_engine(m.engine)


def check_ort_optimized(opt) -> None:
    if not isinstance(opt.onnxruntime, str) or not opt.onnxruntime:
        raise PackageError(f"ort_optimized.onnxruntime must be a string (a version), got {opt.onnxruntime!r}")
    if not isinstance(opt.level, str):
        raise PackageError(f"ort_optimized.level must be a string, got {opt.level!r}")
    for name in ("shared_bytes", "own_bytes"):
        value = getattr(opt, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PackageError(f"ort_optimized.{name} must be an int >= 0, got {value!r}")


def check_cold_tier_types(tier) -> None:
    """The cold tier's fields that ``TierConfig`` / ``HotnessConfig`` do not type-check themselves."""
    for name in ("k_granularity", "v_granularity", "cold_format"):
        if not isinstance(getattr(tier, name), str):
            raise PackageError(f"cold_tier.{name} must be a string, got {getattr(tier, name)!r}")
    if not is_int(tier.group_size) or tier.group_size < 0:
        raise PackageError(f"cold_tier.group_size must be an int >= 0, got {tier.group_size!r}")
    if tier.cold_format_version is not None and not is_int(tier.cold_format_version):
        raise PackageError(f"cold_tier.cold_format_version must be an int, got {tier.cold_format_version!r}")
    if not isinstance(tier.inputs, list) or not all(isinstance(x, str) for x in tier.inputs):
        raise PackageError(f"cold_tier.inputs must be a list of names, got {tier.inputs!r}")
    check_optional("cold_tier.int8_layers_source", tier.int8_layers_source, str, "a string")
