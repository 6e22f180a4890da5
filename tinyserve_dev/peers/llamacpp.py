"""llama.cpp as a benchmark peer: a child process in llama-cpp-python's own venv.

``LlamaCppPeer`` starts ``llamacpp_child.py`` with that venv's python (the benchmark process never
imports ``llama_cpp``), loads one GGUF with ``Llama(model, n_ctx, n_threads=T, n_batch=512,
logits_all=False)`` and times, through the child, ``eval(ids)`` (a prefill) and decode steps
(one ``eval([tok])`` each). ``unavailable`` gives the one reason the column is skipped, or None.
``scripts/setup_llamacpp.sh`` builds the venv and the GGUFs where ``llamacpp_dir`` says.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

CHILD = Path(__file__).resolve().with_name("llamacpp_child.py")
SETUP = "scripts/setup_llamacpp.sh"


class PeerError(RuntimeError):
    """The llama.cpp child failed: one line, the child's own reason."""


def llamacpp_dir() -> Path:
    """``$TINYSERVE_LLAMACPP_DIR``, else ``$TINYSERVE_CACHE/llamacpp`` (default ``~/.cache/tinyserve``)."""
    if os.environ.get("TINYSERVE_LLAMACPP_DIR"):
        return Path(os.environ["TINYSERVE_LLAMACPP_DIR"]).expanduser()
    return Path(os.environ.get("TINYSERVE_CACHE", Path.home() / ".cache" / "tinyserve")).expanduser() / "llamacpp"


def default_python() -> Path:
    return llamacpp_dir() / "venv" / "bin" / "python"


def unavailable(python: str | Path | None, gguf: str | Path | None) -> str | None:
    """Why the llama.cpp column cannot run (one line), or None. Checks files only; a venv that
    cannot import llama_cpp is reported when the child starts (``PeerError``)."""
    if python is None or not Path(python).is_file():
        return f"llama.cpp skipped: no llama-cpp-python venv python at {python} (bash {SETUP})"
    if gguf is None:
        return f"llama.cpp skipped: no --gguf given (bash {SETUP} converts the package's weights to F32 GGUF)"
    if not Path(gguf).is_file():
        return f"llama.cpp skipped: no GGUF at {gguf} (bash {SETUP})"
    return None


class LlamaCppPeer:
    """One llama.cpp model in a child process; requests are answered in order. Close it (or use
    it as a context manager): the child holds the model's memory."""

    def __init__(self, python: str | Path, gguf: str | Path, n_ctx: int, threads: int, n_batch: int = 512):
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen([str(python), str(CHILD)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, text=True)
        try:
            ready = self._ask(dict(model=str(gguf), n_ctx=int(n_ctx), threads=int(threads), n_batch=int(n_batch)))
        except PeerError:
            self.close()
            raise
        self.version, self.n_vocab, self.load_s = ready["version"], ready["n_vocab"], ready["load_s"]

    def _ask(self, request: dict) -> dict:
        if self._proc.poll() is not None:
            raise PeerError(f"llama.cpp child exited ({self._proc.returncode}){self._stderr_tail()}")
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # the child died: its reason is read below
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait()
            raise PeerError(f"llama.cpp child exited ({self._proc.returncode}) without an answer"
                            f"{self._stderr_tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise PeerError(f"llama.cpp: {reply['error']}")
        return reply

    def _stderr_tail(self) -> str:
        self._stderr.seek(0)
        lines = [x for x in self._stderr.read().splitlines() if x.strip()]
        return f": {lines[-1][:200]}" if lines else ""

    def eval(self, ids: list[int], start: int = 0) -> dict:
        """Cut the cache to ``start`` tokens, then ``eval(ids)``: ``{seconds, next, peak_rss}``
        (the greedy next token; the child's peak RSS in bytes, 0 where unknown)."""
        return self._ask(dict(op="eval", start=int(start), ids=[int(i) for i in ids]))

    def steps(self, start: int, token: int, steps: int) -> list[float]:
        """Cut the cache to ``start`` tokens, then ``steps`` greedy decode steps from ``token``:
        seconds of each (one ``eval([tok])`` and its argmax)."""
        return self._ask(dict(op="steps", start=int(start), token=int(token), steps=int(steps)))["seconds"]

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write(json.dumps(dict(op="quit")) + "\n")
                self._proc.stdin.flush()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout):
            stream.close()
        self._stderr.close()

    def __enter__(self) -> LlamaCppPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
