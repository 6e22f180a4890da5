"""benchmarks/bench_peers.py end to end on the tiny package, llama.cpp played by a stand-in (no timing asserted)."""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
FAKE = Path(__file__).resolve().parent / "fake_llama_cpp"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake_llamacpp(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(FAKE))
    gguf = tmp_path / "tiny-f32.gguf"
    gguf.write_bytes(b"GGUF")
    return ["--gguf", str(gguf), "--llamacpp-python", sys.executable]


def cells(text: str, prefix: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith(prefix))
    return [c.strip() for c in line.strip("|").split("|")]


def test_decode_table_has_every_column(llama, tmp_path, capsys, fake_llamacpp):
    out = tmp_path / "peers.md"
    assert load("bench_peers").main(["--model", str(llama[1]), *fake_llamacpp, "--contexts", "40", "--batches", "1,2",
                                     "--budget", "16", "--steps", "3", "--passes", "1", "--threads", "1",
                                     "--bandwidth-mib", "8", "--out", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"RESULT sparse_vs_genai_40_b1=nan sparse_vs_llamacpp_40_b1=\d+\.\d+", last)
    text = out.read_text()
    assert "Threads: 1 for every system. Median of 3 decode steps, best of 1 passes." in text
    assert re.search(r"load at start [\d.]+ / [\d.]+ / [\d.]+; commit \w+", text)
    assert re.search(r"Measured read bandwidth: \d+\.\d GB/s \(numpy max over 8 MiB of float32, 1 threads", text)
    assert "llama-cpp-python 0.0.fake" in text and "genai skipped: no --genai-model given" in text
    b1, b2 = cells(text, "| 40 | 1 |"), cells(text, "| 40 | 2 |")
    assert b1[5] != "n/a" and b1[7] != "n/a" and b1[12] != "n/a"  # llama.cpp time, sparse / llama.cpp, its bytes
    assert b2[5] == "n/a" and b2[9] != "n/a"  # batch 2: no llama.cpp; tinyserve's bytes are there
    assert re.fullmatch(r"\d+ \(\d+%\)", b1[9])


def test_passes_turn_the_systems_order_and_the_table_gives_per_pass_ratios(llama, tmp_path, capsys, fake_llamacpp):
    bench = load("bench_peers")
    assert [bench.pass_order(p)[0] for p in range(4)] == ["tinyserve", "genai", "llama.cpp", "tinyserve"]
    assert all(sorted(bench.pass_order(p)) == sorted(bench.PASS_ORDER) for p in range(3))
    out = tmp_path / "peers.md"
    assert bench.main(["--model", str(llama[1]), *fake_llamacpp, "--contexts", "40", "--budget", "16", "--steps", "2",
                       "--passes", "3", "--threads", "1", "--bandwidth-mib", "8", "--out", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"RESULT sparse_vs_genai_40_b1=nan sparse_vs_llamacpp_40_b1=\d+\.\d+ "
                        r"sparse_vs_llamacpp_40_b1_pass_median=\d+\.\d+", last)
    row = cells(out.read_text(), "| 40 | 1 |")
    assert re.fullmatch(r"\d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d, median \d+\.\d\d\)", row[7])


def test_missing_venv_skips_the_column_with_one_reason(llama, tmp_path, capsys):
    out = tmp_path / "peers.md"
    assert load("bench_peers").main(["--model", str(llama[1]), "--llamacpp-python", str(tmp_path / "none" / "python"),
                                     "--contexts", "40", "--budget", "16", "--steps", "2", "--passes", "1",
                                     "--threads", "1", "--bandwidth-mib", "8", "--out", str(out)]) == 0
    text = out.read_text()
    reasons = [x for x in text.splitlines() if "llama.cpp skipped" in x]
    assert len(reasons) == 1 and "no llama-cpp-python venv python at" in reasons[0]
    assert cells(text, "| 40 | 1 |")[5] == "n/a"
    assert "llama.cpp skipped" in capsys.readouterr().err


def test_prefill_mode(llama, tmp_path, capsys, fake_llamacpp):
    out = tmp_path / "prefill.md"
    assert load("bench_peers").main(["--model", str(llama[1]), "--mode", "prefill", *fake_llamacpp,
                                     "--contexts", "24,40", "--passes", "2", "--threads", "1", "--bandwidth-mib", "8",
                                     "--out", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"RESULT prefill_40_tinyserve_vs_llamacpp=\d+\.\d+", printed[-1])
    assert any(re.search(r"prefill 24: .*tinyserve peak RSS \d+\.\d\d GiB", x) for x in printed)
    row = cells(out.read_text(), "| 40 |")
    assert all(c != "n/a" for c in row) and float(row[4]) > 0  # tinyserve's peak RSS in GiB


def test_bad_input_exits_2(llama, capsys):
    with pytest.raises(SystemExit) as e:
        load("bench_peers").main(["--model", str(llama[1]), "--contexts", "1"])
    assert e.value.code == 2



@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama_cpp is importable here")
def test_a_child_that_cannot_start_is_one_reason_for_every_context(llama, tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    gguf, out = tmp_path / "m.gguf", tmp_path / "peers.md"
    gguf.write_bytes(b"GGUF")
    assert load("bench_peers").main(["--model", str(llama[1]), "--gguf", str(gguf), "--llamacpp-python", sys.executable,
                                     "--contexts", "40,48", "--budget", "16", "--steps", "2", "--passes", "1",
                                     "--threads", "1", "--bandwidth-mib", "8", "--out", str(out)]) == 0
    text = out.read_text()
    reasons = [x for x in text.splitlines() if "llama.cpp skipped" in x]
    assert len(reasons) == 1 and "No module named 'llama_cpp'" in reasons[0]
    assert cells(text, "| 40 | 1 |")[5] == cells(text, "| 48 | 1 |")[5] == "n/a"


def test_a_genai_model_that_fails_is_one_reason(llama, tmp_path):
    out = tmp_path / "peers.md"
    assert load("bench_peers").main(["--model", str(llama[1]), "--genai-model", str(tmp_path / "no-genai"),
                                     "--no-llamacpp", "--contexts", "40,48", "--budget", "16", "--steps", "2",
                                     "--passes", "2", "--threads", "1", "--bandwidth-mib", "8", "--out", str(out)]) == 0
    text = out.read_text()
    assert len([x for x in text.splitlines() if x.startswith("- genai skipped")]) in (1, 2)  # one per context at most
    assert cells(text, "| 40 | 1 |")[4] == "n/a" and "- llama.cpp skipped: --no-llamacpp" in text


def test_genai_prefill_that_cannot_fit_runs_its_graph_instead(monkeypatch):
    """GenAI's own prefill would not fit (one piece at batch > 1): its graph runs as its generator
    runs it (GenaiGraphTimer, test_genai_graph.py), prefilled in pieces, with a note."""
    bench = load("bench_peers")
    rows4 = [[1] * 16384] * 4
    assert bench.genai_scores_bytes(14, rows4, 1024) == 4 * 14 * 16384 * 16384 * 4  # one piece at batch > 1
    assert bench.genai_scores_bytes(14, rows4[:1], 1024) == 14 * 1024 * 16384 * 4  # pieces at batch 1
    monkeypatch.setattr(bench, "GenaiTimer", lambda *a: pytest.fail("GenAI's generator must not start"))
    import tinyserve_dev.peers.genai_graph as genai_graph

    monkeypatch.setattr(genai_graph, "GenaiGraphTimer", lambda *a: ("graph", a))
    args, notes = types.SimpleNamespace(genai_model=Path("m"), genai_chunk=1024, steps=2, threads=1), []
    assert bench.start_genai(args, rows4, notes, 14) == ("graph", (Path("m"), rows4, 2, 1, 1024))
    assert len(notes) == 1 and notes[0].startswith("genai at context 16384 batch 4: GenAI's own model.onnx")
    assert "56 GiB of attention scores" in notes[0]
    monkeypatch.setattr(bench, "GenaiTimer", lambda *a: ("generator", a))  # it fits at batch 1: GenAI itself
    assert bench.start_genai(args, rows4[:1], notes, 14)[0] == "generator" and len(notes) == 1


def test_contexts_past_the_model_are_cut_to_leave_the_steps_room():
    fit, notes = load("bench_peers").fit_contexts, []
    assert fit([512, 32768], 32768, 16, notes) == [512, 32744]  # 32768 + 16 + 8 is past GenAI's max_length
    assert notes == ["context 32768 cut to 32744: the model holds 32768 positions, the 16 timed steps and 8 more "
                     "go after the prompt"]
    assert fit([32744, 40000], 32768, 16, []) == [32744]  # one row per context left
    with pytest.raises(SystemExit, match="--steps 40 leaves no room"):
        fit([16], 48, 40, [])


def test_without_budget_sparse_runs_the_packages_default_at_each_context(llama, tmp_path, capsys):
    from tinyserve_trt.contracts.budget import DecodeBudget
    from tinyserve_trt.runtime.model_package import ModelPackage

    out, pkg = tmp_path / "peers.md", ModelPackage.load(llama[1])
    assert load("bench_peers").main(["--model", str(llama[1]), "--no-llamacpp", "--contexts", "40,64", "--steps", "2",
                                     "--passes", "1", "--threads", "1", "--bandwidth-mib", "8", "--out", str(out)]) == 0
    text, printed = out.read_text(), capsys.readouterr().out
    for context in (40, 64):
        budget = DecodeBudget(pkg.token_budget, pkg.budget_share).at(context)
        assert f"- sparse budget at context {context}: {budget} tokens (the package's default)" in text
        assert f"context {context} batch 1 budget {budget}" in printed
    assert "budget the package's (" in text


def test_a_budget_below_one_is_refused():
    with pytest.raises(SystemExit):
        load("bench_peers").parse(["--model", "x", "--budget", "0"])
