"""The built-in calibration text: prompts for ``tinyserve-calibrate`` without ``--data`` and for
``tinyserve-export``'s automatic INT8-layer pick (``auto_int8.py``).

``data/default_prompts.txt`` is this project's own documentation (README and docs/, written by
``tinyserve_dev/default_prompts.py``; shipped as package data), never one of the evaluation texts
the benchmarks measure on. :func:`default_prompts` cuts it at paragraph breaks into pieces of at
least ``PIECE_CHARS`` characters: ~2300 SmolLM2 tokens each (the text averages 3.05 characters a
token), so each piece fills the 2048-token prompts the sensitivity pass runs on.
"""

from __future__ import annotations

from importlib import resources

DATA_FILE = "default_prompts.txt"
PIECE_CHARS = 7000
NAME = "the built-in text"  # how summaries and artifacts name it


def default_text() -> str:
    """The whole text (package data of ``tinyserve_trt.calibration``)."""
    return resources.files("tinyserve_trt.calibration").joinpath("data", DATA_FILE).read_text(encoding="utf-8")


def default_prompts(piece_chars: int = PIECE_CHARS) -> list[str]:
    """The text in order, as pieces of whole paragraphs of at least ``piece_chars`` characters
    (the last piece joins its predecessor when shorter)."""
    if piece_chars < 1:
        raise ValueError(f"piece_chars must be positive, got {piece_chars}")
    pieces, current = [], []
    size = 0
    for para in (p for p in default_text().split("\n\n") if p.strip()):
        current.append(para)
        size += len(para) + 2
        if size >= piece_chars:
            pieces.append("\n\n".join(current))
            current, size = [], 0
    if current:
        tail = "\n\n".join(current)
        if pieces:
            pieces[-1] += "\n\n" + tail
        else:
            pieces.append(tail)
    return pieces
