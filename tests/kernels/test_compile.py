"""The CUDA sources and the TensorRT glue compile (CPU only: nothing runs). CI runs this."""

import os
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


def test_trt_plugin_compiles(tmp_path):
    """Needs TensorRT headers: $TENSORRT_INCLUDE_DIR (e.g. include/ of the public NVIDIA/TensorRT repo)."""
    nvcc = nvcc_or_skip()
    inc = os.environ.get("TENSORRT_INCLUDE_DIR")
    if not inc or not (Path(inc) / "NvInfer.h").is_file():
        pytest.skip("set TENSORRT_INCLUDE_DIR to a directory holding NvInfer.h to compile the plugin glue")
    for src in sorted((ROOT / "plugins" / "tensorrt").glob("*.cpp")):  # the glue and its field parsing
        subprocess.run([nvcc, "-x", "c++", "-std=c++17", "-Xcompiler", "-Wall,-Wextra,-Wno-deprecated-declarations",
                        f"-I{inc}", f"-I{KERNELS}", f"-I{src.parent}", "-c", str(src),
                        "-o", str(tmp_path / f"{src.stem}.o")], check=True)
