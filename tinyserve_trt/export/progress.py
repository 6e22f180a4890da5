"""The export's progress on stderr: one numbered line per phase, a bar inside the long ones.

``tinyserve-export: [4/6 write] writing model.onnx.data`` starts a phase; ``advance`` moves its
bar (bytes written, validation runs done), redrawn in place on a terminal and left out
elsewhere (CI logs get the phase lines only); ``done`` ends the phase with its time. Quiet: nothing.
"""

from __future__ import annotations

import sys
import time

PHASES = ("load", "match", "rewrite", "write", "validate", "package")
WIDTH = 24


class Progress:
    def __init__(self, quiet: bool = False, stream=None):
        self.quiet, self.stream = quiet, stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.phase, self.total, self.done_units, self.unit, self.t0 = None, 0, 0, "", 0.0

    def start(self, phase: str, message: str, total: int = 0, unit: str = "") -> None:
        """Begin ``phase`` (one of ``PHASES``); ``total`` units for its bar (0: no bar)."""
        self.end()
        self.phase, self.total, self.done_units, self.unit, self.t0 = phase, total, 0, unit, time.perf_counter()
        self._line(f"[{PHASES.index(phase) + 1}/{len(PHASES)} {phase}] {message}")

    def note(self, message: str) -> None:
        """A line inside the current phase."""
        self._clear()
        self._line(message)

    def advance(self, units: int = 1) -> None:
        if self.phase is None or not self.total:
            return
        self.done_units = min(self.total, self.done_units + units)
        if self.tty and not self.quiet:
            share = self.done_units / self.total
            bar = "#" * round(share * WIDTH)
            self.stream.write(f"\r  [{bar.ljust(WIDTH)}] {share:4.0%} {_amount(self.done_units, self.unit)}"
                              f"/{_amount(self.total, self.unit)}")
            self.stream.flush()

    def end(self) -> float:
        """Close the current phase; its seconds (0 if none was open)."""
        if self.phase is None:
            return 0.0
        seconds = time.perf_counter() - self.t0
        self._clear()
        self.phase = None
        return seconds

    def _clear(self) -> None:
        if self.tty and not self.quiet and self.total:
            self.stream.write("\r" + " " * (WIDTH + 40) + "\r")

    def _line(self, text: str) -> None:
        if not self.quiet:
            print(f"tinyserve-export: {text}", file=self.stream, flush=True)


def _amount(n: int, unit: str) -> str:
    if unit == "B":
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
    return f"{n}{(' ' + unit) if unit else ''}"
