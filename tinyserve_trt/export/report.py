"""The summary table tinyserve-export prints at the end."""

from __future__ import annotations

from .config import ExportConfig
from .pipeline import ExportReport


def print_summary(report: ExportReport, config: ExportConfig) -> None:
    rows = [("output", str(report.outdir)), ("layers rewritten", str(report.layers))]
    rows += [(f"  rule {name}", str(n)) for name, n in sorted(report.rule_counts.items())]
    rows += [("page size", str(config.resolved_page_size())),
             ("default token budget", str(config.token_budget) if config.token_budget else "dense"),
             ("dense layers", str(min(config.dense_layers, report.layers))),
             ("validation max |logit diff|",
              f"{report.validation:.2e} (<= {config.tolerance():g})" if report.validation is not None
              else "skipped"),
             ("package size", _size(report)),
             ("time", ", ".join(f"{k} {v:.1f}s" for k, v in report.seconds.items()))]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))


def _size(report: ExportReport) -> str:
    """Package size, and how it compares with the model's weights (held once: ~1.0x)."""
    text = f"{report.size_bytes / 2**20:.1f} MiB"
    if report.weight_bytes:
        text += f" ({report.size_bytes / report.weight_bytes:.2f}x the weights, {report.weight_bytes / 2**20:.1f} MiB)"
    return text
