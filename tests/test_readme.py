"""README.md opens with the two set-up commands, and CI runs the same test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_opens_with_main_job_and_test_command():
    lines = ROOT.joinpath("README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1: lines.index("```bash") + 3]
    assert block[0].startswith("bash scripts/setup.sh && ") and "main job" in block[0]
    assert block[1].split("#")[0].strip() == "bash scripts/setup.sh && bash scripts/test.sh"
    assert lines.index("```bash") < 5


def test_ci_runs_the_readme_commands():
    ci = ROOT.joinpath(".ci/run").read_text()
    assert "bash scripts/setup.sh" in ci and "bash scripts/test.sh" in ci


def test_bare_import():
    import subprocess, sys
    code = "import sys, tinyserve_trt, tinyserve_trt.ops; assert 'torch' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"
