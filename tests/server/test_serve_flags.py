"""``tinyserve serve``'s security flags (issue #29): the API key from a file or the environment
(never needing the command line, which ``ps`` shows); and the scale-out doc's deployment advice."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tinyserve_trt.runtime.cli import _server_config, build_parser, main

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-file-0123456789"


def _config(argv, monkeypatch, env_key=None):
    if env_key is None:
        monkeypatch.delenv("TINYSERVE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("TINYSERVE_API_KEY", env_key)
    return _server_config(build_parser().parse_args(["serve", "/pkg", *argv]))


def test_api_key_from_a_file_the_environment_or_the_flag(monkeypatch, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    assert _config(["--api-key-file", str(key_file)], monkeypatch).api_key == KEY
    assert _config([], monkeypatch, env_key=KEY).api_key == KEY
    assert _config(["--api-key-file", str(key_file)], monkeypatch, env_key="sk-env").api_key == KEY
    assert _config([], monkeypatch).api_key is None


def test_api_key_file_problems_are_one_line_exit_2(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("TINYSERVE_API_KEY", raising=False)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path, match in ((tmp_path / "missing", "cannot read"), (empty, "empty")):
        assert main(["serve", str(tmp_path / "pkg"), "--api-key-file", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--api-key-file" in err and match in err, err
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    with pytest.raises(SystemExit):  # argparse: not both
        build_parser().parse_args(["serve", "/pkg", "--api-key", KEY, "--api-key-file", str(key_file)])


def test_scale_out_doc_keeps_the_dashboard_and_the_key_private():
    doc = (ROOT / "docs" / "scale_out.md").read_text()
    assert "--include-dashboard=false" in doc
    for m in re.finditer(r"--dashboard-host=0\.0\.0\.0", doc):  # only ever as a warning
        assert "Never" in doc[max(0, m.start() - 40):m.start()], doc[m.start() - 80:m.end()]
    assert not re.search(r"--api-key[ =]+[\"'$]", doc), "the key on the command line is visible in ps"
    assert "--api-key-file" in doc and "TINYSERVE_API_KEY" in doc and "--allowed-host" in doc
    assert "## What is trusted" in doc
