"""The export's progress: a numbered line per phase, a bar inside write and validate on a terminal."""

from __future__ import annotations

import io

from tinyserve_trt.export.progress import PHASES, Progress

from .test_cli import run


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_bar_on_a_terminal_only():
    tty, log = _Tty(), io.StringIO()
    for stream in (tty, log):
        p = Progress(stream=stream)
        p.start("write", "writing", total=4 * 2**20, unit="B")
        p.advance(2**20)
        p.advance(3 * 2**20)
        p.advance(2**20)  # past the total: clamped
        p.end()
    assert "[4/6 write] writing" in tty.getvalue() and "[4/6 write] writing" in log.getvalue()
    assert "25%" in tty.getvalue() and "100% 4 MiB/4 MiB" in tty.getvalue()
    assert "\r" not in log.getvalue() and "%" not in log.getvalue()  # CI logs: phase lines only
    quiet = _Tty()
    p = Progress(quiet=True, stream=quiet)
    p.start("load", "x", total=2)
    p.advance()
    assert quiet.getvalue() == ""


def test_export_prints_every_phase(capsys, tmp_path, export_fixture):
    got, _, err = run(capsys, export_fixture("llama", "legacy_sdpa") / "model.onnx", "-o", tmp_path / "pkg")
    assert got == 0, err
    seen = [ph for ph in PHASES if f"/{len(PHASES)} {ph}]" in err]
    assert seen == list(PHASES), err
