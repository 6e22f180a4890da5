"""The summary table tinyserve-export prints at the end."""

from __future__ import annotations

from dataclasses import replace

from ..contracts.cold_tier import INT4_GROUP_SIZE, TierConfig, cold_page_bytes, cold_page_ratio
from ..contracts.dense_layers import describe as describe_dense_layers
from ..ops import fine_bounds
from ..ops.cold_codec import INT4_FORMAT_VERSION
from .config import ExportConfig
from .pipeline import ExportReport


def print_summary(report: ExportReport, config: ExportConfig) -> None:
    if report.max_context:  # as the export resolved it (the model's config.json, by default)
        config = replace(config, max_context=report.max_context)
    rows = [("output", str(report.outdir)), ("layers rewritten", str(report.layers))]
    rows += [(f"  rule {name}", str(n)) for name, n in sorted(report.rule_counts.items())]
    rows += [("projections packed", f"{report.packed_matmuls} MatMuls folded into their neighbours' (QKV, gate/up)"),
             ("max context", f"{config.max_context} tokens ({report.max_context_from})" if report.max_context
              else "unknown"),
             ("page size", str(config.resolved_page_size())),
             ("selection", _selection(config)),
             ("bytes / token / KV head", _bytes_per_token(report, config)),
             ("cold page", _cold_page(report, config)),
             ("default token budget", config.decode_budget.describe()),
             ("dense layers", describe_dense_layers(config.dense_layers, report.layers)),
             ("validation max |logit diff|",
              f"{report.validation:.2e} (<= {report.tolerance or config.tolerance():.3g}"
              + (f"; the source's own noise {report.source_noise:.1e}" if report.source_noise is not None else "") + ")"
              if report.validation is not None
              else "skipped"),
             ("ORT graph opset", _ort_opset(report)),
             ("ORT graph decode", report.ort_decode or "no ORT graph"),
             ("package size", _size(report)),
             ("time", _time(report)),
             ("peak memory", _peak_memory(report))]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))


def _size(report: ExportReport) -> str:
    """Package size, and how it compares with the model's weights (held once: ~1.0x)."""
    text = f"{report.size_bytes / 2**20:.1f} MiB"
    if report.weight_bytes:
        text += f" ({report.size_bytes / report.weight_bytes:.2f}x the weights, {report.weight_bytes / 2**20:.1f} MiB)"
    return text


def _time(report: ExportReport) -> str:
    return f"{sum(report.seconds.values()):.1f}s (" + ", ".join(f"{k} {v:.1f}s" for k, v in report.seconds.items()) + ")"


def _peak_memory(report: ExportReport) -> str:
    """Peak RSS of this process so far (the export's; the whole command's when it only exported),
    against the weights' bytes: issue #30 bounds it at 2.5x."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    text = f"{peak / 2**30:.2f} GiB RSS"
    if report.weight_bytes:
        text += f" ({peak / report.weight_bytes:.2f}x the weights)"
    return text


def _selection(config: ExportConfig) -> str:
    sub = config.resolved_sub_page_size()
    group = {"head": "per query head", "max": "per KV head (group max)", "sum": "per KV head (group sum)"}[
        config.resolved_group_reduce]
    if not sub or sub == config.resolved_page_size():
        return f"{config.policy} {group}, single level"
    pages = "every page's" if config.candidate_share >= 1 else f"the top {config.candidate_share:.0%} of pages'"
    return f"{config.policy} {group}, two-level: {pages} {sub}-token sub-pages"


def _bytes_per_token(report: ExportReport, config: ExportConfig) -> str:
    """K+V and selection metadata per token, KV head and layer, in the cache dtype."""
    if not report.head_dim:
        return "unknown"
    width = 2 if report.kv_dtype == "float16" else 4
    kv = fine_bounds.kv_bytes_per_token(report.head_dim, width)
    meta = fine_bounds.metadata_bytes_per_token(config.resolved_page_size(), config.resolved_sub_page_size(),
                                                report.head_dim, width)
    return f"{report.kv_dtype} pages: KV {kv}, selection metadata {meta:g} ({meta / kv:.1%})"


def _ort_opset(report: ExportReport) -> str:
    """model.ort.onnx's ai.onnx opset beside the source's, and why it was not raised when it was not."""
    if report.ort_opset is None:
        return "no ORT graph"
    text = f"{report.ort_opset} (source {report.source_opset})"
    return f"{text}; {report.ort_opset_note}" if report.ort_opset_note else text


def _cold_page(report: ExportReport, config: ExportConfig) -> str:
    """What a cold page costs per FP16 page (``contracts.cold_tier.cold_page_ratio``), default V granularity."""
    if not config.has_cold_tier:
        return "none (no cold tier)"
    if not report.head_dim:
        return "unknown"
    fmt = config.resolved_cold_format
    tiers = TierConfig(cold_format=fmt, group_size=INT4_GROUP_SIZE if fmt == "int4" else 0)
    ratio = cold_page_ratio(tiers, config.resolved_page_size(), report.head_dim)
    name = f"int4 (format {INT4_FORMAT_VERSION})" if fmt == "int4" else fmt
    text = f"{name}: {ratio:.3f} of an FP16 page"
    if fmt == "int4":
        layers = ",".join(map(str, report.int8_layers)) or "none"
        text += f"; int8 layers {layers} ({report.int8_layers_source})"
        if report.int8_layers:  # what a cold page costs over all layers, each in its own format
            mixed = replace(tiers, int8_layers=report.int8_layers)
            ps, d = config.resolved_page_size(), report.head_dim
            hot = report.layers * (2 * ps * d + 2 * d) * 2
            text += f", {cold_page_bytes(mixed, ps, report.layers, 1, d) / hot:.3f} over all layers"
    return text
