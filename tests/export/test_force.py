"""``--force`` replaces a previous package or an empty folder, nothing else (issue #29).

Before the fix ``package.write_package`` ran ``shutil.rmtree(outdir)`` on whatever OUTDIR was:
``-o . --force`` emptied the working directory, ``-o <source folder>`` deleted the source.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tinyserve_trt.contracts.manifest import MANIFEST_FILE

from .test_cli import one_line, run


def _copy_source(export_fixture, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(export_fixture("gpt2", "legacy_eager"), src)
    return src / "model.onnx"


def test_force_on_the_working_directory_touches_nothing(capsys, tmp_path, export_fixture, monkeypatch):
    src = _copy_source(export_fixture, tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    got, _, err = run(capsys, src, "-o", ".", "-q", "--force")
    assert got == 2 and "--force" in one_line(err)
    assert (work / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]


def test_force_on_the_source_folder_refused(capsys, tmp_path, export_fixture):
    src = _copy_source(export_fixture, tmp_path)
    before = sorted(p.name for p in src.parent.iterdir())
    got, _, err = run(capsys, src, "-o", src.parent, "-q", "--force")
    assert got == 2 and "source" in one_line(err)
    assert sorted(p.name for p in src.parent.iterdir()) == before


def test_force_on_a_parent_of_the_source_refused(capsys, tmp_path, export_fixture):
    src = _copy_source(export_fixture, tmp_path)
    (tmp_path / MANIFEST_FILE).write_text("{}")  # even one that looks like a package
    got, _, err = run(capsys, src, "-o", tmp_path, "-q", "--force")
    assert got == 2 and one_line(err)
    assert src.is_file()


def test_force_on_a_file_refused(capsys, tmp_path, export_fixture):
    src = _copy_source(export_fixture, tmp_path)
    target = tmp_path / "a_file"
    target.write_text("keep")
    got, _, err = run(capsys, src, "-o", target, "-q", "--force")
    assert got == 2 and one_line(err)
    assert target.read_text() == "keep"


def test_force_on_a_folder_with_an_invalid_manifest_refused(capsys, tmp_path, export_fixture):
    src = _copy_source(export_fixture, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST_FILE).write_text("not json")
    (out / "data.bin").write_text("keep")
    got, _, err = run(capsys, src, "-o", out, "-q", "--force")
    assert got == 2 and one_line(err)
    assert (out / "data.bin").read_text() == "keep"


def test_force_on_a_symlink_refused(capsys, tmp_path, export_fixture):
    src = _copy_source(export_fixture, tmp_path)
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    got, _, err = run(capsys, src, "-o", tmp_path / "link", "-q", "--force")
    assert got == 2 and "symlink" in one_line(err)
    assert (tmp_path / "link").is_symlink() and real.is_dir()


def test_force_replaces_an_empty_folder_and_a_package(capsys, tmp_path, export_fixture):
    src = _copy_source(export_fixture, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    got, _, _ = run(capsys, src, "-o", out, "-q", "--force")
    assert got == 0 and (out / MANIFEST_FILE).is_file()
    first = json.loads((out / MANIFEST_FILE).read_text())
    got, _, _ = run(capsys, src, "-o", out, "-q", "--force", "--page-size", "8", "--sub-page-size", "0")
    assert got == 0
    assert json.loads((out / MANIFEST_FILE).read_text())["page_size"] != first["page_size"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # nothing left beside it


def test_failed_replacement_keeps_the_old_package(capsys, tmp_path, export_fixture, monkeypatch):
    src = _copy_source(export_fixture, tmp_path)
    out = tmp_path / "out"
    assert run(capsys, src, "-o", out, "-q")[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def boom(tmp, manifest):
        raise OSError("disk full")

    monkeypatch.setattr("tinyserve_trt.export.pipeline._ort_graph_saver", lambda config, plan=None: boom)
    got, _, err = run(capsys, src, "-o", out, "-q", "--force")
    assert got != 0 and one_line(err)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_swap_failure_restores_the_old_package(tmp_path, monkeypatch):
    """The rename that puts the new package in place fails: the old one is moved back."""
    from tinyserve_trt.export import outdir as outdir_mod

    old = tmp_path / "pkg"
    old.mkdir()
    (old / "model.onnx").write_text("old")
    new = tmp_path / ".pkg.new"
    new.mkdir()
    (new / "model.onnx").write_text("new")
    real_replace = outdir_mod.os.replace
    calls = []

    def flaky(a, b):
        calls.append((a, b))
        if len(calls) == 2:
            raise OSError("injected")
        return real_replace(a, b)

    monkeypatch.setattr(outdir_mod.os, "replace", flaky)
    with pytest.raises(OSError):
        outdir_mod.swap_in(new, old)
    assert (old / "model.onnx").read_text() == "old"


def test_force_without_existing_output_is_fine(capsys, tmp_path, export_fixture):
    src = _copy_source(export_fixture, tmp_path)
    got, _, _ = run(capsys, src, "-o", tmp_path / "fresh", "-q", "--force")
    assert got == 0


def test_calibrate_output_npz_refused(tmp_path, capsys):
    """``tinyserve-calibrate -o out.npz`` wrote the JSON over its own arrays (issue #29)."""
    from tinyserve_trt.calibration import cli as cal_cli

    with pytest.raises(SystemExit) as e:
        cal_cli.main([str(tmp_path), "-o", str(tmp_path / "out.npz")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and ".npz" in one_line(err)
