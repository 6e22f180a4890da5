import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]




def nvcc_or_skip() -> str:
    nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc")
    if not nvcc:
        pytest.skip("nvcc not on PATH (and $CUDACXX unset): cannot compile the CUDA sources")
    return nvcc


def _emulated_lib():
    """The kernels built by g++ against plugins/emulation (rebuilt when a source is newer)."""
    from tinyserve_trt.cuda import library

    if not (os.environ.get("CXX") or shutil.which("g++")):
        pytest.skip("no CUDA device and no g++ (or $CXX) to build the CPU-emulated kernel library")
    subprocess.run([sys.executable, str(ROOT / "plugins" / "build.py"), "--emulate", "--if-stale",
                    "--out", str(library.EMULATED_LIB.parent)], check=True)
    return library.use(library.EMULATED_LIB)


@pytest.fixture(scope="session")
def cuda_lib():
    """The kernel library the GPU tests drive: the nvcc build on a CUDA device (built for
    it if missing), else the same sources built for the CPU emulation (host memory).
    $TINYSERVE_QSA_LIB, when set, is used as is."""
    from tinyserve_trt.cuda import library

    if os.environ.get(library.LIB_ENV):
        return library.use(library.library_path())
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed: the harness holds the kernels' buffers in torch tensors")
    if not torch.cuda.is_available():
        return _emulated_lib()
    if not library.library_path().is_file():
        nvcc_or_skip()
        major, minor = torch.cuda.get_device_capability()
        subprocess.run([sys.executable, str(ROOT / "plugins" / "build.py"), "--arch", f"{major}{minor}"],
                       check=True)
    return library.use(library.library_path())
