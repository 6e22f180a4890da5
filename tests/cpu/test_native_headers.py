"""The CPU node builds from the one copy of each C++ contract header (issue #32): the schema header
generated into plugins/generated and the math of plugins/kernels, taken with -I from a source
checkout's plugins/ or an installed wheel's cuda/plugin_sources/ - never a second copy in cpu/csrc."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tinyserve_trt.cpu import native

ROOT = Path(__file__).resolve().parents[2]
TREES = ("tinyserve_trt", "plugins", "tinyserve_dev", "tests", "benchmarks", "scripts")  # where sources live


def test_each_shared_header_exists_once_in_the_tree():
    names = [Path(h).name for h in native.SHARED_HEADERS]
    for name in names:
        copies = [p.relative_to(ROOT).as_posix() for tree in TREES for p in (ROOT / tree).rglob(name)]
        assert copies == [f"plugins/{h}" for h in native.SHARED_HEADERS if h.endswith("/" + name)], \
            f"{name}: {copies} (one copy, in plugins/; the node's build takes it with -I)"


def _includes(path: Path) -> list[str]:
    return re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), flags=re.MULTILINE)


def test_the_node_includes_exactly_its_sources_and_the_shared_headers():
    """Every quoted include of the node's sources (and of the shared headers) is a file of csrc/ or one
    of SHARED_HEADERS, so the build cache key, which hashes those, covers everything compiled."""
    root = native.plugin_source_root()
    shared = {Path(h).name: root / h for h in native.SHARED_HEADERS}
    local = {p.name for p in native.SOURCE_DIR.iterdir()}
    used = set()
    for path in [*native.SOURCE_DIR.iterdir(), *shared.values()]:
        for inc in _includes(path):
            assert inc in local or inc in shared, f"{path.name} includes {inc!r}: not in csrc/ nor SHARED_HEADERS"
            used.add(inc)
    assert set(shared) <= used, f"SHARED_HEADERS lists headers the node does not include: {set(shared) - used}"
    keyed = native._source_files(native.SOURCE_DIR)
    assert {f"plugins/{h}" for h in native.SHARED_HEADERS} <= set(keyed)


def test_without_the_plugin_sources_the_build_is_unavailable_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "PLUGIN_SOURCE_ROOTS", (tmp_path / "a", tmp_path / "b"))
    with pytest.raises(native.NativeUnavailable, match="shared C\\+\\+ headers") as info:
        native.build(native.SOURCE_DIR, tmp_path / "cache")
    assert "\n" not in str(info.value)


@pytest.mark.skipif(shutil.which(native.compiler()) is None or native.available() is not None,
                    reason="no C++ compiler / native build here")
def test_an_installed_package_builds_the_node_from_its_plugin_sources(rng, tmp_path):
    """setup.py's build_py writes the installed layout (the package data and plugins/ as
    cuda/plugin_sources/); its native.py, loaded from there, finds the headers there and builds a
    library that equals the reference."""
    from tinyserve_dev.cases import CaseSpec, make_case
    from tinyserve_trt.ops import schema

    from .test_native_op import check_case

    lib_dir = tmp_path / "site"
    env = {**os.environ, "TINYSERVE_WHEEL_NATIVE": "0"}  # the layout only: no prebuilt library
    (tmp_path / "egg").mkdir()  # egg_info's output goes there, not into the source tree
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path / "egg"), "build_py",
                    "--build-lib", str(lib_dir)], cwd=ROOT, env=env, check=True, capture_output=True)
    spec = importlib.util.spec_from_file_location("_installed_native", lib_dir / "tinyserve_trt" / "cpu" / "native.py")
    installed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(installed)
    assert installed.plugin_source_root() == lib_dir / "tinyserve_trt" / "cuda" / "plugin_sources"
    assert not any((installed.SOURCE_DIR / Path(h).name).exists() for h in installed.SHARED_HEADERS)
    lib = installed.build(installed.SOURCE_DIR, tmp_path / "cache")
    case = make_case(CaseSpec((16 * 7 + 3, 16 * 4), 4, 2, 16, 16, budget=3 * 16, sub_page_size=4), rng)
    for sp in (0, 4):
        check_case(case, schema.OpAttributes(sub_page_size=sp), lib=lib)
