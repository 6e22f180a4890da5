"""The markdown tables of ``benchmarks/bench_peers.py``: decode steps and prefill, beside the peers.

Decode: one row per (context, batch); per system its step time (and tokens/s), the step-time
ratios the issue's must-shows are stated in (tinyserve / peer: < 1 is faster), and the bytes a step
reads with the share of the measured read bandwidth it reaches (``step_bytes``). Prefill: one row
per prompt length; tokens/s of each system and its peak RSS. A column that did not run says n/a,
and the header says why.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from tinyserve_dev.peers.step_bytes import StepBytes

SYSTEMS = ("sparse", "dense", "genai", "llama.cpp")
RATIOS = (("sparse", "genai"), ("sparse", "llama.cpp"), ("dense", "llama.cpp"))
GIB, MB = 2 ** 30, 1e6


@dataclass(frozen=True)
class TableHeader:
    """What the header states: the run's conditions, measured before it started."""

    title: str
    command: str
    machine: str
    threads: int
    measure: str  # e.g. "median of 16 decode steps, best of 2 passes"
    load: str  # os.getloadavg at start
    commit: str
    bandwidth: float  # bytes/s, machine.read_bandwidth
    models: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    probe_mib: int = 1024  # the bandwidth probe's array

    def lines(self) -> list[str]:
        out = [f"# {self.title}", "", f"Command: `{self.command}`", "",
               f"Machine: {self.machine}; load at start {self.load}; commit {self.commit}. "
               f"Threads: {self.threads} for every system. {self.measure[0].upper() + self.measure[1:]}.",
               f"Measured read bandwidth: {self.bandwidth / 1e9:.1f} GB/s (numpy max over {self.probe_mib} MiB of float32, "
               f"{self.threads} threads, best of 3).", f"Models: {self.models}."]
        out += [f"- {n}" for n in self.notes]
        return out + [""]


@dataclass(frozen=True)
class DecodeRow:
    context: int
    batch: int
    seconds: dict  # system -> seconds per step of the whole batch (best of the passes)
    bytes: dict  # system -> StepBytes
    passes: tuple = ()  # per pass, system -> seconds: the ratios within each pass


def pass_ratios(row: DecodeRow, a: str, b: str) -> list[float]:
    """a / b in each pass that timed both (measured seconds apart, so a slow spell of the machine
    that lasts a pass hits both)."""
    return [p[a] / p[b] for p in row.passes if p.get(a) and p.get(b)]


def _ratio_cell(row: DecodeRow, a: str, b: str) -> str:
    s = row.seconds
    if not (s.get(a) and s.get(b)):
        return "n/a"
    cell = f"{s[a] / s[b]:.2f}x"
    each = sorted(pass_ratios(row, a, b))
    if len(each) > 1:
        cell += f" ({each[0]:.2f}-{each[-1]:.2f}, median {statistics.median(each):.2f})"
    return cell


def _time_cell(seconds: float | None, batch: int) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ({batch / seconds:.0f})"


def _bytes_cell(b: StepBytes | None, seconds: float | None, bandwidth: float) -> str:
    if b is None:
        return "n/a"
    share = f" ({b.share(seconds, bandwidth):.0%})" if seconds else ""
    return f"{b.total / MB:.0f}{share}"


def decode_table(header: TableHeader, rows: list[DecodeRow]) -> str:
    cols = [f"{s} ms/step (tok/s)" for s in SYSTEMS] + [f"{a} / {b}" for a, b in RATIOS]
    cols += [f"{s} MB/step (BW share)" for s in SYSTEMS]
    lines = header.lines() + [
        "Step-time ratios are tinyserve / peer (below 1: tinyserve is faster): of the best passes, then in "
        "parentheses the range and median of the ratio within each pass. MB/step: the weights a step "
        "streams plus the KV it attends (benchmarks/bench_peers.py --help); BW share: those bytes / step "
        "time / the measured read bandwidth.", "",
        "| context | batch | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for r in rows:
        s = r.seconds
        cells = [_time_cell(s.get(k), r.batch) for k in SYSTEMS]
        cells += [_ratio_cell(r, a, b) for a, b in RATIOS]
        cells += [_bytes_cell(r.bytes.get(k), s.get(k), header.bandwidth) for k in SYSTEMS]
        lines.append(f"| {r.context} | {r.batch} | " + " | ".join(cells) + " |")
    over = max((r.bytes[k].share(r.seconds[k], header.bandwidth) for r in rows for k in SYSTEMS
                if r.bytes.get(k) and r.seconds.get(k)), default=0.0)
    if over > 1.0:  # a step cannot read faster than the machine: the probe ran slower than a step did
        lines += ["", f"A step read faster than the measured bandwidth (up to {over:.0%} of it): the probe "
                      "underestimated this machine's read bandwidth during the run, so compare the shares "
                      "between rows, not with 100%."]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class PrefillRow:
    tokens: int
    seconds: dict  # system -> seconds of the whole prompt (best of the passes)
    peak_rss: dict  # system -> bytes, the peak RSS of that system's process during its runs


def prefill_table(header: TableHeader, rows: list[PrefillRow], systems=("tinyserve", "llama.cpp")) -> str:
    cols = [f"{s} tok/s" for s in systems] + [f"{systems[0]} / {s}" for s in systems[1:]]
    cols += [f"{s} peak RSS GiB" for s in systems]
    lines = header.lines() + [
        f"One prompt of token ids; tokens/s = prompt tokens / time to the first token. "
        f"{systems[0]} / x: tokens/s ratio (above 1: {systems[0]} prefills faster).", "",
        "| prompt tokens | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for r in rows:
        s, rss = r.seconds, r.peak_rss
        cells = [f"{r.tokens / s[k]:.0f}" if s.get(k) else "n/a" for k in systems]
        cells += [f"{s[k] / s[systems[0]]:.2f}x" if s.get(k) and s.get(systems[0]) else "n/a" for k in systems[1:]]
        cells += [f"{rss[k] / GIB:.2f}" if rss.get(k) else "n/a" for k in systems]
        lines.append(f"| {r.tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
