"""The CUDA sources and the TensorRT glue compile (CPU only: nothing runs). CI runs this; the
IPluginV3 adapter needs TensorRT's headers (``$TENSORRT_INCLUDE_DIR``), the plugin's core does not."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, nvcc_or_skip

KERNELS = ROOT / "plugins" / "kernels"


@pytest.mark.parametrize("source", sorted(p.name for p in KERNELS.glob("*.cu")))
def test_kernel_source_compiles(source, tmp_path):
    nvcc = nvcc_or_skip()
    # one arch keeps this quick; plugins/build.py --check compiles the full list
    subprocess.run([nvcc, "-std=c++17", "-O3", "-arch=sm_80", "-Werror", "all-warnings", f"-I{KERNELS}", "-c",
                    str(KERNELS / source), "-o", str(tmp_path / "k.o")], check=True)


def test_kernel_library_links(tmp_path):
    nvcc_or_skip()
    subprocess.run([sys.executable, str(ROOT / "plugins" / "build.py"), "--arch", "80", "--out", str(tmp_path)],
                   check=True)
    assert (tmp_path / "libqsa_kernels.so").is_file()


CORE_SOURCES = ("QsaPluginCore.cpp", "QsaPluginFields.cpp")


@pytest.mark.parametrize("source", CORE_SOURCES)
def test_plugin_core_compiles_without_tensorrt(source, tmp_path):
    """The plugin's TensorRT-free core, as CMake builds it (C++17), with no TensorRT include path."""
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        pytest.skip("no g++ (or $CXX)")
    src = ROOT / "plugins" / "tensorrt" / source
    subprocess.run([cxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", f"-I{KERNELS}", f"-I{src.parent}", "-c",
                    str(src), "-o", str(tmp_path / f"{src.stem}.o")], check=True)


def test_trt_plugin_compiles(tmp_path):
    """Needs TensorRT headers: $TENSORRT_INCLUDE_DIR (e.g. include/ of the public NVIDIA/TensorRT repo)."""
    nvcc = nvcc_or_skip()
    inc = os.environ.get("TENSORRT_INCLUDE_DIR")
    if not inc or not (Path(inc) / "NvInfer.h").is_file():
        pytest.skip("set TENSORRT_INCLUDE_DIR to a directory holding NvInfer.h to compile the plugin glue")
    for src in sorted((ROOT / "plugins" / "tensorrt").glob("*.cpp")):  # the adapter and the core
        subprocess.run([nvcc, "-x", "c++", "-std=c++17", "-Xcompiler", "-Wall,-Wextra,-Wno-deprecated-declarations",
                        f"-I{inc}", f"-I{KERNELS}", f"-I{src.parent}", "-c", str(src),
                        "-o", str(tmp_path / f"{src.stem}.o")], check=True)
