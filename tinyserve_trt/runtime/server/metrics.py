"""Prometheus text exposition (format 0.0.4) for the server, without a client library.

Request counters and latency histograms are updated by the handlers (event-loop
thread only); engine gauges (queue, pages, hit rates) are read from
``Engine.stats()`` at scrape time, on the engine thread, so they are consistent.
"""

from __future__ import annotations

import math
from collections import defaultdict

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    esc = (v.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n") for _, v in pairs)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(pairs, esc)) + "}"


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class Counter:
    def __init__(self, name: str, help: str):
        self.name, self.help = name, help
        self.values: dict[tuple, float] = defaultdict(float)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] += amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        lines += [f"{self.name}{_labels(k)} {_num(v)}" for k, v in sorted(self.values.items())]
        return lines


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, tuple(buckets) + (math.inf,)
        self.counts = [0] * len(self.buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
                break
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for upper, c in zip(self.buckets, self.counts):
            total += c
            lines.append(f'{self.name}_bucket{{le="{_num(upper)}"}} {total}')
        return lines + [f"{self.name}_sum {_num(self.sum)}", f"{self.name}_count {self.count}"]


def gauge(name: str, help: str, values: dict[tuple, float] | float | None) -> list[str]:
    """Lines of one gauge: a value, or label tuples -> value; None renders NaN (not yet known)."""
    lines = [f"# HELP {name} {help}", f"# TYPE {name} gauge"]
    if not isinstance(values, dict):
        return lines + [f"{name} {'NaN' if values is None else _num(values)}"]
    return lines + [f"{name}{_labels(k)} {_num(v)}" for k, v in values.items()]


class ServerMetrics:
    """What ``GET /metrics`` reports. Times are seconds, measured at the server (what a client sees)."""

    def __init__(self):
        self.requests = Counter("tinyserve_requests_total",
                                "Requests answered, by endpoint and HTTP status (499: client went away "
                                "mid-request; a stream that timed out counts as 504)")
        self.prompt_tokens = Counter("tinyserve_prompt_tokens_total", "Prompt tokens of finished requests")
        self.generation_tokens = Counter("tinyserve_generation_tokens_total", "Tokens generated")
        self.ttft = Histogram("tinyserve_time_to_first_token_seconds",
                              "Request arrival to its first generated token", TTFT_BUCKETS)
        self.tpot = Histogram("tinyserve_time_per_output_token_seconds",
                              "Mean time between generated tokens of a request, after the first", TPOT_BUCKETS)
        self.e2e = Histogram("tinyserve_request_latency_seconds", "Request arrival to its last token", E2E_BUCKETS)

    def render(self, engine: dict, waiting: int, running: int, in_flight: int, sequences_in_flight: int = 0) -> str:
        """``engine``: ``Engine.stats()``; ``waiting`` / ``running``: the scheduler's sequence counts;
        ``in_flight``: requests the server holds; ``sequences_in_flight``: their sequences (admission's count)."""
        lines = []
        for m in (self.requests, self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e):
            lines += m.render()
        lines += gauge("tinyserve_requests_in_flight", "Requests accepted and not yet answered", in_flight)
        lines += gauge("tinyserve_sequences_in_flight", "Sequences (prompts x n) of the requests in flight; "
                       "admission's count", sequences_in_flight)
        lines += gauge("tinyserve_queue_depth", "Sequences waiting for a batch slot or pages", waiting)
        lines += gauge("tinyserve_running_sequences", "Sequences in the running batch", running)
        lines += gauge("tinyserve_kv_pages", "KV pages by state: free, used (held by live sequences), cached "
                       "(idle, kept for prefix reuse, evictable)",
                       {(("state", "free"),): engine["pages_free"], (("state", "used"),): engine["pages_in_use"],
                        (("state", "cached"),): engine["pages_cached_idle"]})
        lines += gauge("tinyserve_kv_pages_total", "KV pages in the pool", engine["pages_total"])
        lines += gauge("tinyserve_prefix_cache_hit_rate", "Prompt tokens whose prefill was skipped by the "
                       "prefix cache / prompt tokens", engine["prefix_hit_rate"])
        lines += gauge("tinyserve_selected_page_rate", "Decode: KV pages attended / KV pages available "
                       "(sparse layers; 1 = dense)", engine["page_selection_rate"])
        lines += gauge("tinyserve_token_budget", "Default Quest decode budget in tokens (0 = dense)",
                       engine["token_budget"])
        lines += gauge("tinyserve_preemptions", "Sequences preempted for pages so far", engine["preemptions"])
        lines += kernel_lines(engine)
        lines += _kv_store_lines(engine)
        lines += [f"# HELP tinyserve_engine_step_failures_total Engine steps that raised (their requests were "
                  f"failed, the engine went on)", "# TYPE tinyserve_engine_step_failures_total counter",
                  f"tinyserve_engine_step_failures_total {_num(engine.get('step_failures', 0))}"]
        return "\n".join(lines) + "\n"


KERNEL_LABELS = (("graph", "kernel_graph"), ("decode", "kernel_decode"), ("cold_format", "kernel_cold_format"),
                 ("provider", "kernel_provider"), ("reason", "kernel_reason"))


def kernel_lines(engine: dict) -> list[str]:
    """The engine's kernel report (``Engine.stats()``'s ``kernel_*``) as an info gauge (value 1, the
    report in its labels) and ``tinyserve_kernel_fallback`` (1: a slower graph or kernel than the
    package ships runs here); nothing when the engine has no report."""
    if "kernel_decode" not in engine:
        return []
    labels = tuple((label, str(engine.get(key) or "")) for label, key in KERNEL_LABELS)
    return (gauge("tinyserve_kernel_info", "What the engine runs: graph file, decode kernel (native_cpu, "
                  "onnx_function, cuda_ep, tensorrt_plugin), cold format, provider, and why it is not native",
                  {labels: 1})
            + gauge("tinyserve_kernel_fallback", "1 when the engine fell back to a slower graph or decode kernel "
                    "than the package ships (the reason label of tinyserve_kernel_info says why)",
                    1 if engine.get("kernel_fallback") else 0))


def _kv_store_lines(engine: dict) -> list[str]:
    """Prefix pages reused by tier, the page store's bytes moved and size, TTFT by prefix source
    (issue #33). Counters and sums only, so a fleet's merge (``ray_metrics``) adds them up."""
    tiers = {(("tier", t),): engine.get(f"prefix_pages_{t}", 0) for t in ("pool", "host", "disk")}
    lines = _counter("tinyserve_prefix_pages_reused_total", "Prompt pages whose prefill was skipped, by where "
                     "they came from: the pool, or the page store's host memory or disk (--kv-cache-dir)", tiers)
    moved = {(("tier", t), ("direction", d)): engine.get(f"kv_store_{t}_{k}", 0)
             for t in ("host", "disk") for d, k in (("read", "hit_bytes"), ("written", "put_bytes"))}
    lines += _counter("tinyserve_kv_store_bytes_total", "Bytes of KV pages read from / written to the page store",
                      moved)
    lines += gauge("tinyserve_kv_store_bytes", "Bytes the page store holds, by tier",
                   {(("tier", t),): engine.get(f"kv_store_{t}_bytes", 0) for t in ("host", "disk")})
    by_source = engine.get("ttft_by_prefix_source", {})
    lines += _counter("tinyserve_ttft_by_prefix_source_seconds_sum", "Sum of engine-side TTFTs by where the "
                      "prompt's prefix came from (none, pool, host, disk)",
                      {(("source", s),): v["sum_s"] for s, v in by_source.items()})
    lines += _counter("tinyserve_ttft_by_prefix_source_seconds_count", "Requests counted in the sum above",
                      {(("source", s),): v["requests"] for s, v in by_source.items()})
    return lines


def _counter(name: str, help: str, values: dict[tuple, float]) -> list[str]:
    return [f"# HELP {name} {help}", f"# TYPE {name} counter"] + [
        f"{name}{_labels(k)} {_num(v)}" for k, v in values.items()]


def parse_metrics(text: str) -> dict[str, float]:
    """``'name{labels}' -> value`` of a text exposition (for tests and the benchmark)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
