"""The peer benchmark's tables: cells, ratios, bytes and shares, n/a and the header's facts (fixed inputs)."""

from __future__ import annotations

from tinyserve_dev.peers.peer_table import DecodeRow, PrefillRow, TableHeader, decode_table, pass_ratios, prefill_table
from tinyserve_dev.peers.step_bytes import StepBytes

HEADER = TableHeader(title="Decode test", command="python benchmarks/bench_peers.py --model P",
                     machine="x86_64, 2 cores", threads=2, measure="median of 16 decode steps, best of 2 passes",
                     load="1.50 / 1.00 / 0.50",
                     commit="abc1234", bandwidth=20e9, models="`pkg`",
                     notes=("llama.cpp skipped: no GGUF at /x.gguf (bash scripts/setup_llamacpp.sh)",))


def test_decode_table_cells():
    b = StepBytes(weights=500_000_000, kv=40_000_000)
    rows = [DecodeRow(512, 1, {"sparse": 0.030, "dense": 0.032, "genai": 0.060}, {"sparse": b, "dense": b, "genai": b}),
            DecodeRow(512, 4, {"sparse": 0.050}, {"sparse": b})]
    text = decode_table(HEADER, rows)
    lines = text.splitlines()
    assert lines[0] == "# Decode test"
    assert "Threads: 2 for every system. Median of 16 decode steps, best of 2 passes." in text
    assert "load at start 1.50 / 1.00 / 0.50; commit abc1234" in text
    assert "Measured read bandwidth: 20.0 GB/s (numpy max over 1024 MiB of float32, 2 threads, best of 3)" in text
    assert "- llama.cpp skipped: no GGUF at /x.gguf" in text
    head = next(x for x in lines if x.startswith("| context"))
    cells = [c.strip() for c in head.strip("|").split("|")]
    assert cells[:6] == ["context", "batch", "sparse ms/step (tok/s)", "dense ms/step (tok/s)", "genai ms/step (tok/s)",
                         "llama.cpp ms/step (tok/s)"]
    row1 = [c.strip() for c in next(x for x in lines if x.startswith("| 512 | 1 |")).strip("|").split("|")]
    # 540 MB / 0.030 s / 20 GB/s = 90 %; 540 MB / 0.060 s / 20 GB/s = 45 %
    assert row1 == ["512", "1", "30.0 (33)", "32.0 (31)", "60.0 (17)", "n/a", "0.50x", "n/a", "n/a",
                    "540 (90%)", "540 (84%)", "540 (45%)", "n/a"]
    row4 = [c.strip() for c in next(x for x in lines if x.startswith("| 512 | 4 |")).strip("|").split("|")]
    assert row4[2] == "50.0 (80)" and row4[3:9] == ["n/a"] * 6 and row4[9] == "540 (54%)"
    assert "faster than the measured bandwidth" not in text  # every share <= 100%


def test_a_share_over_the_measured_bandwidth_is_flagged():
    """540 MB in 20 ms at a measured 20 GB/s is 135% of it: the probe, not the step, was wrong - the
    table says so instead of printing an impossible share silently."""
    b = StepBytes(weights=500_000_000, kv=40_000_000)
    text = decode_table(HEADER, [DecodeRow(512, 1, {"sparse": 0.020, "dense": 0.030}, {"sparse": b, "dense": b})])
    assert "540 (135%)" in text
    assert ("A step read faster than the measured bandwidth (up to 135% of it): the probe underestimated this "
            "machine's read bandwidth during the run") in text


def test_ratio_cells_give_each_pass_ratio_beside_the_ratio_of_the_bests():
    """Passes timed seconds apart: the ratio within each pass (range, median) beside best / best -
    here the two bests fall in different passes (a slow spell in pass 2 hit both systems)."""
    b = StepBytes(weights=500_000_000, kv=40_000_000)
    passes = ({"sparse": 0.040, "llama.cpp": 0.060}, {"sparse": 0.030, "llama.cpp": 0.050},
              {"sparse": 0.033, "llama.cpp": 0.044})
    row = DecodeRow(8000, 1, {"sparse": 0.030, "llama.cpp": 0.044}, {"sparse": b, "llama.cpp": b}, passes)
    assert [round(x, 3) for x in pass_ratios(row, "sparse", "llama.cpp")] == [0.667, 0.6, 0.75]
    assert pass_ratios(row, "sparse", "genai") == []
    text = decode_table(HEADER, [row])
    cells = [c.strip() for c in next(x for x in text.splitlines() if x.startswith("| 8000 | 1 |")).strip("|").split("|")]
    assert cells[6:9] == ["n/a", "0.68x (0.60-0.75, median 0.67)", "n/a"]
    assert "the range and median of the ratio within each pass" in text
    one = DecodeRow(8000, 1, {"sparse": 0.030, "llama.cpp": 0.044}, {"sparse": b}, passes[:1])
    assert "0.68x |" in decode_table(HEADER, [one])  # one pass: no range to give


def test_prefill_table_cells():
    rows = [PrefillRow(512, {"tinyserve": 1.0, "llama.cpp": 0.5}, {"tinyserve": 2 * 2 ** 30, "llama.cpp": 2 ** 29}),
            PrefillRow(2048, {"tinyserve": 4.0}, {"tinyserve": 3 * 2 ** 30})]
    lines = prefill_table(HEADER, rows).splitlines()
    assert [c.strip() for c in next(x for x in lines if x.startswith("| 512 |")).strip("|").split("|")] == [
        "512", "512", "1024", "0.50x", "2.00", "0.50"]
    assert [c.strip() for c in next(x for x in lines if x.startswith("| 2048 |")).strip("|").split("|")] == [
        "2048", "512", "n/a", "n/a", "3.00", "n/a"]
