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


@pytest.fixture(scope="session")
def cuda_lib():
    """The kernel library, built for this GPU if missing; skips without a CUDA device."""
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed: the GPU harness runs kernels on torch CUDA tensors")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    from tinyserve_trt.cuda import library

    if not library.library_path().is_file():
        nvcc_or_skip()
        major, minor = torch.cuda.get_device_capability()
        subprocess.run([sys.executable, str(ROOT / "plugins" / "build.py"), "--arch", f"{major}{minor}"],
                       check=True)
    return library.load()
