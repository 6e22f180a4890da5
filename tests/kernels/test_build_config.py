"""The two build paths (plugins/build.py, plugins/CMakeLists.txt) target the same GPUs."""

import importlib.util
import re

from .conftest import ROOT


def _build_py():
    spec = importlib.util.spec_from_file_location("qsa_build", ROOT / "plugins" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_arch_lists_agree():
    cmake = (ROOT / "plugins" / "CMakeLists.txt").read_text()
    m = re.search(r"set\(TINYSERVE_CUDA_ARCHS ([\d ]+)\)", cmake)
    assert m, "TINYSERVE_CUDA_ARCHS not found in CMakeLists.txt"
    assert tuple(m.group(1).split()) == _build_py().ARCHS


def test_build_py_lists_every_kernel_source():
    assert {p.name for p in _build_py().SOURCES} == {p.name for p in (ROOT / "plugins" / "kernels").glob("*.cu")}
