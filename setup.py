"""Build steps pyproject.toml cannot declare: what a wheel carries besides the Python package.

* ``plugins/`` (CUDA kernels, TensorRT glue, the generated schema header, the CPU emulation,
  CMakeLists.txt, build.py) is copied to ``tinyserve_trt/cuda/plugin_sources/``, so an installed
  package can build its GPU libraries (``tinyserve-build-plugin``) and the native CPU op, whose
  build includes the headers it shares with the kernels from there (``cpu.native.SHARED_HEADERS``).
  Git keeps one copy: plugins/.
* The native CPU op is compiled once for a baseline CPU (``cpu.native.PREBUILT_MARCH``: no
  AVX2, so it loads on any machine of this architecture) into
  ``tinyserve_trt/cpu/prebuilt/libtinyserve_cpu.abi<N>.<machine>.so`` with the host C++ compiler,
  for machines without one; the runtime prefers its own ``-march=native`` JIT build and uses this
  one only when it cannot compile. No compiler here, or ``TINYSERVE_WHEEL_NATIVE=0``: the wheel
  has no prebuilt library (and stays pure Python); the JIT build is then the only path.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _module(name: str, path: Path):
    """A module of the package loaded by path (the build must not import tinyserve_trt's dependencies)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class BuildPyWithNative(build_py):
    """build_py, then the plugin sources and the prebuilt CPU op into the build tree."""

    prebuilt = False

    def run(self):
        super().run()
        if self.editable_mode:  # an editable install reads plugins/ and builds the op on first use
            return
        self._copy_plugin_sources()
        self._build_prebuilt()

    def _copy_plugin_sources(self) -> None:
        plugin_build = _module("_tinyserve_plugin_build", ROOT / "tinyserve_trt" / "cuda" / "plugin_build.py")
        src = ROOT / "plugins"
        dest = Path(self.build_lib) / "tinyserve_trt" / "cuda" / "plugin_sources"
        shutil.rmtree(dest, ignore_errors=True)
        for path in plugin_build.source_files(src):
            target = dest / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)

    def _build_prebuilt(self) -> None:
        native = _module("_tinyserve_native", ROOT / "tinyserve_trt" / "cpu" / "native.py")
        if os.environ.get("TINYSERVE_WHEEL_NATIVE", "1").strip() == "0":
            print("tinyserve: TINYSERVE_WHEEL_NATIVE=0: no prebuilt native CPU op in this wheel")
            return
        out = Path(self.build_lib) / "tinyserve_trt" / "cpu" / native.PREBUILT_DIR_NAME
        try:
            lib = native.build_prebuilt(out)
        except native.NativeUnavailable as e:
            print(f"tinyserve: no prebuilt native CPU op in this wheel ({e}); the runtime builds it on first use")
            return
        BuildPyWithNative.prebuilt = True
        print(f"tinyserve: prebuilt native CPU op {lib.name}")


cmdclass = {"build_py": BuildPyWithNative}
try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    bdist_wheel = None

if bdist_wheel is not None:
    class BdistWheel(bdist_wheel):
        """A wheel with the prebuilt CPU op is platform-specific (it is loaded by ctypes and ONNX Runtime,
        not by Python: any Python 3, this OS and machine); without it, pure Python as before."""

        def get_tag(self):
            python, abi, plat = super().get_tag()
            if BuildPyWithNative.prebuilt:
                return "py3", "none", plat
            return python, abi, plat

        def run(self):
            self.run_command("build_py")
            if BuildPyWithNative.prebuilt:
                self.root_is_pure = False
                self.plat_name_supplied = False
            super().run()

    cmdclass["bdist_wheel"] = BdistWheel

setup(cmdclass=cmdclass)
