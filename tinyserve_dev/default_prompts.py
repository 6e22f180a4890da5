"""Writes ``tinyserve_trt/calibration/data/default_prompts.txt``: the built-in calibration text.

It is this repository's own documentation (``README.md`` and ``docs/*.md``, ours to ship), so a
package can be calibrated - and ``tinyserve-export`` can pick an INT4 package's INT8 layers - with
no data of the user's. Never an evaluation text (Hamlet, the KJV, Python stdlib sources): the
benchmarks measure on those. Run from the repository root when the docs change:
``python -m tinyserve_dev.default_prompts``.
"""

from __future__ import annotations

import sys
from pathlib import Path

SOURCES = ("README.md", "docs/*.md")
TARGET = Path("tinyserve_trt/calibration/data/default_prompts.txt")


def source_files(root: Path) -> list[Path]:
    return [p for pattern in SOURCES for p in sorted(root.glob(pattern))]


def build(root: Path) -> str:
    """The documents, each as its paragraphs (runs of blank lines collapsed), in source order."""
    parts = []
    for path in source_files(root):
        text = path.read_text(encoding="utf-8").replace("\r\n", "\n")
        paragraphs = [p.strip("\n") for p in text.split("\n\n") if p.strip()]
        parts.append("\n\n".join(paragraphs))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    root = Path(argv[0]) if argv else Path(".")
    text = build(root)
    (root / TARGET).write_text(text, encoding="utf-8")
    print(f"wrote {root / TARGET}: {len(text)} characters from {len(source_files(root))} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
