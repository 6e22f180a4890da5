"""One Prometheus text for a fleet of replicas: each replica's series labelled ``replica="<id>"``,
plus the fleet's series under the same names as one server's (so dashboards and
``parse_metrics`` readers work unchanged).

Fleet values: counters, histograms and counts (pages, queue depth, in-flight) are summed;
rates (``*_rate``) are weighted by each replica's ``tinyserve_prompt_tokens_total`` (an
unweighted mean before any prompt was served); ``tinyserve_token_budget`` is the mean.
``tinyserve_replicas`` counts the replicas that answered.
"""

from __future__ import annotations

import math
import re

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)$")


def _parse(text: str):
    """(families in order: name -> [HELP, TYPE lines], series: [(family, name, labels, value)])."""
    families, series, family = {}, [], None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            family = line.split()[2]
            families.setdefault(family, []).append(line)
        elif line.startswith("# TYPE "):
            family = line.split()[2]
            families.setdefault(family, []).append(line)
        elif line and not line.startswith("#"):
            m = _LINE.match(line)
            if m:
                series.append((family, m.group(1), m.group(2) or "", float(m.group(3))))
    return families, series


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return str(int(x)) if x == int(x) and abs(x) < 1e15 else repr(x)


def _with_replica(labels: str, replica: str) -> str:
    label = f'replica="{replica}"'
    return "{" + label + "}" if not labels else "{" + label + "," + labels[1:]


def merge(texts: dict[str, str]) -> str:
    """``replica id -> its /metrics text`` to one exposition."""
    families: dict[str, list[str]] = {}
    per_family: dict[str, list] = {}
    weights: dict[str, float] = {}
    for rid, text in sorted(texts.items()):
        fams, series = _parse(text)
        for name, header in fams.items():
            families.setdefault(name, header)
        for family, name, labels, value in series:
            per_family.setdefault(family, []).append((rid, name, labels, value))
            if name == "tinyserve_prompt_tokens_total":
                weights[rid] = weights.get(rid, 0.0) + value
    lines = ["# HELP tinyserve_replicas Replicas that answered this scrape", "# TYPE tinyserve_replicas gauge",
             f"tinyserve_replicas {len(texts)}"]
    for family, header in families.items():
        rows = per_family.get(family, [])
        lines += header
        fleet: dict[tuple[str, str], list[tuple[str, float]]] = {}
        for rid, name, labels, value in rows:
            fleet.setdefault((name, labels), []).append((rid, value))
        for (name, labels), values in fleet.items():
            lines.append(f"{name}{labels} {_fmt(_combine(name, values, weights))}")
        lines += [f"{name}{_with_replica(labels, rid)} {_fmt(value)}" for rid, name, labels, value in rows]
    return "\n".join(lines) + "\n"


def _combine(name: str, values: list[tuple[str, float]], weights: dict[str, float]) -> float:
    if name.endswith("_rate"):
        total = sum(weights.get(rid, 0.0) for rid, _ in values)
        if total > 0:
            return sum(v * weights.get(rid, 0.0) for rid, v in values) / total
        return sum(v for _, v in values) / len(values)
    if name == "tinyserve_token_budget":
        return sum(v for _, v in values) / len(values)
    return sum(v for _, v in values)
