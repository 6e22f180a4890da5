"""Machine-readable benchmark results: the JSON every benchmark writes next to its markdown.

``benchmarks/report.py`` reads these files, never the markdown. Common keys
of every ``benchmarks/results/<name>.json``::

    {"benchmark": "<name>", "machine": "x86_64, 2 cores, ...",
     "command": "python benchmarks/...", "created": "<ISO time>", ...}

The decode-throughput format (``decode_cpu.json``, ``gpu_h200.json`` and any
other serving benchmark), which the report plots as tokens/s vs context per
system::

    {"benchmark": "decode", "machine": ..., "command": ..., "created": ...,
     "rows": [{"system": "tinyserve sparse b1024", "context": 8192, "batch": 1,
               "ms_per_token": 12.5, "tokens_per_s": 80.0}, ...]}

``tokens_per_s`` counts generated tokens over all sequences of the batch.
``validate_decode`` checks that shape.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

DECODE_ROW_KEYS = ("system", "context", "batch", "tokens_per_s")


def machine_description(threads: int | None = None) -> str:
    parts = [platform.machine(), f"{os.cpu_count()} cores"]
    if threads:
        parts.append(f"{threads} threads")
    try:
        import torch

        parts.append(f"torch {torch.__version__}")
        if torch.cuda.is_available():
            parts.append(torch.cuda.get_device_name(0))
    except ImportError:
        pass
    try:
        import transformers

        parts.append(f"transformers {transformers.__version__}")
    except ImportError:
        pass
    return ", ".join(parts)


def command_line() -> str:
    """The command that is running, as a user would type it (script path relative to the repo)."""
    argv = list(sys.argv)
    script = Path(argv[0])
    try:
        argv[0] = str(script.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        argv[0] = str(script)
    return "python " + shlex.join(argv)


def write_json(path: Path, benchmark: str, data: dict, machine: str) -> Path:
    record = {"benchmark": benchmark, "machine": machine, "command": command_line(),
              "created": datetime.datetime.now().isoformat(timespec="seconds"), **data}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def validate_decode(record: dict) -> list[dict]:
    """The rows of a decode-throughput record; ValueError naming what is missing."""
    rows = record.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ValueError("decode results need a non-empty 'rows' list")
    for i, row in enumerate(rows):
        missing = [k for k in DECODE_ROW_KEYS if k not in row]
        if missing:
            raise ValueError(f"decode row {i} lacks {missing}")
    return rows
