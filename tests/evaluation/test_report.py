"""benchmarks/report.py on a results folder of small fake records: tables, plots, missing ones marked."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from tinyserve_dev.evaluation.results import validate_decode  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def load_report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


OP_MD = """# op
Machine: x86_64, 2 cores, 2 ORT threads; onnxruntime 1.32.0. Command: `python benchmarks/bench_op.py` (batch 1).

| context | sparse (ms) | (a) op, dense budget (ms) | (b) export (ms) | speedup vs (b) | speedup vs (a) | limit |
|---|---|---|---|---|---|---|
| 2048 | 0.7 | 0.7 | 1.8 | 2.6x | 1.0x | 0.9x |
| 8192 | 0.8 | 2.4 | 7.5 | 9.1x | 2.9x | 3.2x |
"""

QUALITY = dict(
    benchmark="quality", machine="m", command="python benchmarks/quality.py", text="t.txt", context=512,
    prefill_tokens=255, eval_tokens=256, page_size=16, dense_layers=2, dense_ppl=10.0, wall_seconds=3,
    targets={"ppl_ratio_1k": 1.02, "recall_30pct": 0.95}, headline={"ppl_ratio_1k": 1.03, "recall_30pct": 0.96},
    runs=[dict(policy="dense", budget=0, dense_layers=0, ppl=10.0, ratio=1.0)]
    + [dict(policy=p, budget=b, dense_layers=2, ppl=10.3, ratio=1.03) for p in ("query_aware", "window")
       for b in (256, 1024)] + [dict(policy="query_aware", budget=1024, dense_layers=0, ppl=10.4, ratio=1.04)],
    recall={p: {f: dict(mean=0.9, mean_dense_layers=0.92, per_layer=[0.9, 0.9]) for f in ("0.1", "0.3")}
            for p in ("query_aware", "oracle")})

PASSKEY = dict(benchmark="passkey", machine="m", command="python benchmarks/passkey.py", policy="query_aware",
               dense_layers=2, budgets=[128, 512], depths=[0.5], wall_seconds=1,
               accuracy={"1024": {"dense": 1.0, "128": 0.0, "512": 1.0}}, headline={
                   "passkey_acc_b512": 1.0, "passkey_acc_dense": 1.0})

DECODE = dict(benchmark="decode", machine="m", command="python benchmarks/decode.py",
              rows=[dict(system="tinyserve", context=c, batch=1, tokens_per_s=100.0 / c * 1024) for c in (1024, 4096)])


def test_report_collects_present_and_marks_missing(tmp_path):
    (tmp_path / "op_cpu.md").write_text(OP_MD)
    (tmp_path / "quality.json").write_text(json.dumps(QUALITY))
    (tmp_path / "passkey.json").write_text(json.dumps(PASSKEY))
    (tmp_path / "decode_cpu.json").write_text(json.dumps(DECODE))
    report = load_report()
    assert report.main(["--results", str(tmp_path)]) == 0
    text = (tmp_path / "REPORT.md").read_text()
    for png in ("op_speedup.png", "quality_ppl.png", "quality_recall.png", "passkey_heatmap.png",
                "decode_tokens.png"):
        assert (tmp_path / png).stat().st_size > 1000, png
        assert png in text
    assert "| 8192 | 0.800 | 2.400 | 7.500 | 9.38x |" in text
    assert "**missed** by 1.00 points" in text and "**met**" in text
    assert "| gpu_h200 |" in text and "**missing**" in text
    assert text.count("Command: `") >= 4


def test_report_without_results(tmp_path):
    report = load_report()
    assert report.main(["--results", str(tmp_path)]) == 0
    assert "Missing: no quality.json" in (tmp_path / "REPORT.md").read_text()


def test_decode_format_validation():
    assert len(validate_decode(DECODE)) == 2
    with pytest.raises(ValueError, match="lacks"):
        validate_decode(dict(rows=[dict(system="x", context=1)]))
