"""benchmarks/bench_scale.py end to end on the tiny package, tiny sizes (a local Ray cluster of
2 CPUs; no timing asserted). In a process of its own, as the benchmark is run: a Ray driver keeps
Ray's native threads after ray.shutdown() until it exits (tests/server/ray_driver.py), and pytest
must not be one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="needs ray[serve] (the scale extra)")
pytest.importorskip("httpx")


def test_bench_scale_smoke(llama, tmp_path):
    out = tmp_path / "scale.md"
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_scale.py"), "--model", str(llama[1]),
                          "--systems", "2", "--requests", "3", "--concurrency", "2", "--max-tokens", "2",
                          "--system-chars", "80", "--max-batch", "4", "--threads", "1", "--num-cpus", "2",
                          "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    last = res.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"RESULT hit_rate_prefix=(\d\.\d+) hit_rate_default=(\d\.\d+) tok_s_2v1=\d+\.\d+ ttft_warm_over_cold=\d+\.\d+", last)
    assert m
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["routing"], r["replicas"]): r for r in data["rows"]}
    assert set(rows) == {("prefix", 2), ("default", 2), ("prefix", 1)}
    assert all(r["requests"] == 6 for r in rows.values())
    # prefix-aware: each system prompt has one owner, warmed by the unmeasured request, so every
    # measured request reuses its system prompt's pages (most of its prompt)
    assert rows["prefix", 2]["prefix_hit_rate"] > 0.5 and rows["prefix", 1]["prefix_hit_rate"] > 0.5
    assert len(rows["prefix", 2]["prompt_tokens_by_replica"]) == 2
    assert "| prefix | 2 | 1 | 6 |" in out.read_text()
    # warm-up: the system prompts prefilled on their owners, so each prefix's first request
    # reuses them; without warm-up the first request of each prefix has nothing to reuse
    cold, warm = data["warmup"]
    assert (cold["warmup"], warm["warmup"]) == (False, True) and cold["requests"] == warm["requests"] == 2
    assert warm["prefix_hit_rate"] > 0.5 > cold["prefix_hit_rate"]
