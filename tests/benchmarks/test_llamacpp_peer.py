"""The llama.cpp child-process protocol, run for real against a stand-in ``llama_cpp`` (no llama.cpp needed)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tinyserve_dev.peers import llamacpp

FAKE = Path(__file__).resolve().parent / "fake_llama_cpp"


@pytest.fixture
def fake_env(tmp_path, monkeypatch):
    """(gguf path, call log) with the stand-in llama_cpp importable by the child."""
    monkeypatch.setenv("PYTHONPATH", str(FAKE))
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    gguf = tmp_path / "model-f32.gguf"
    gguf.write_bytes(b"GGUF")
    return gguf, log


def calls(log: Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def test_eval_and_steps_round_trip(fake_env):
    gguf, log = fake_env
    with llamacpp.LlamaCppPeer(sys.executable, gguf, n_ctx=64, threads=2) as peer:
        assert peer.version == "0.0.fake" and peer.n_vocab == 10
        first = peer.eval([4, 5, 6])
        assert first["next"] == 7 and first["seconds"] >= 0  # stdout noise of the library did not break it
        assert first["peak_rss"] > 0 or not Path("/proc/self/status").exists()
        times = peer.steps(3, first["next"], 4)
        assert len(times) == 4 and all(t >= 0 for t in times)
        again = peer.steps(3, first["next"], 2)  # each pass cuts the cache back to the prompt
        assert len(again) == 2
    seen = calls(log)
    assert [(c["n_past"], c["n"]) for c in seen] == [(0, 3), (3, 1), (4, 1), (5, 1), (6, 1), (3, 1), (4, 1)]
    assert seen[0]["threads"] == [2, 2]  # prefill and decode threads alike


def test_prefill_recomputes_from_start_zero(fake_env):
    gguf, log = fake_env
    with llamacpp.LlamaCppPeer(sys.executable, gguf, n_ctx=16, threads=1) as peer:
        for _ in range(2):
            peer.eval(list(range(12)), start=0)
    assert [(c["n_past"], c["n"]) for c in calls(log)] == [(0, 12), (0, 12)]


def test_child_errors_are_one_line(fake_env, tmp_path):
    gguf, _ = fake_env
    with pytest.raises(llamacpp.PeerError, match=r"^llama.cpp: ValueError: Failed to load model from file"):
        llamacpp.LlamaCppPeer(sys.executable, tmp_path / "missing.gguf", n_ctx=16, threads=1)
    with llamacpp.LlamaCppPeer(sys.executable, gguf, n_ctx=8, threads=1) as peer:
        with pytest.raises(llamacpp.PeerError, match="outside the 0 cached tokens"):
            peer.steps(5, 1, 1)
        with pytest.raises(llamacpp.PeerError, match="n_ctx 8"):
            peer.eval(list(range(9)))
        assert peer.eval([1])["next"] == 2  # the child still answers after an error


def test_a_child_that_dies_is_reported(tmp_path):
    crash = tmp_path / "python"
    crash.write_text("#!/bin/sh\necho 'boom: no such library' >&2\nexit 3\n")
    crash.chmod(0o755)
    with pytest.raises(llamacpp.PeerError, match=r"exited \(3\).*boom: no such library"):
        llamacpp.LlamaCppPeer(crash, tmp_path / "m.gguf", n_ctx=8, threads=1)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama_cpp is importable here")
def test_a_python_without_llama_cpp(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(llamacpp.PeerError, match="No module named 'llama_cpp'"):
        llamacpp.LlamaCppPeer(sys.executable, gguf, n_ctx=8, threads=1)


def test_unavailable_gives_one_reason(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert llamacpp.unavailable(sys.executable, gguf) is None
    no_venv = llamacpp.unavailable(tmp_path / "venv" / "bin" / "python", gguf)
    assert no_venv.startswith("llama.cpp skipped: no llama-cpp-python venv python") and "setup_llamacpp.sh" in no_venv
    assert "no --gguf given" in llamacpp.unavailable(sys.executable, None)
    assert "no GGUF at" in llamacpp.unavailable(sys.executable, tmp_path / "other.gguf")
    for reason in (no_venv, llamacpp.unavailable(sys.executable, None)):
        assert "\n" not in reason


def test_default_dir_follows_the_cache_variables(tmp_path, monkeypatch):
    monkeypatch.delenv("TINYSERVE_LLAMACPP_DIR", raising=False)
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path))
    assert llamacpp.default_python() == tmp_path / "llamacpp" / "venv" / "bin" / "python"
    monkeypatch.setenv("TINYSERVE_LLAMACPP_DIR", str(tmp_path / "elsewhere"))
    assert llamacpp.llamacpp_dir() == tmp_path / "elsewhere"
