"""The export's output folder: what ``--force`` may replace, and the swap that replaces it.

``--force`` replaces a previous package (a folder whose ``tinyserve.json`` loads) or an
empty folder - never a file, a symlink, the source's folder or a folder above it, or a
folder above the working directory. The new package is built in a temporary sibling and
swapped in with renames (``swap_in``): the old package is moved aside, the new one moved
into place, and only then is the old one deleted, so a failure at any point leaves the old
package (or nothing) at OUTDIR. Nothing is deleted that the export did not create or that
is not a package.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..contracts.manifest import MANIFEST_FILE, Manifest, PackageError
from .errors import InputError


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_output(outdir: Path, overwrite: bool, sources: tuple[Path, ...] = ()) -> None:
    """Raise ``InputError`` unless ``outdir`` may be written (``overwrite``: replaced).

    Does not touch the file system. ``sources``: files the export reads (the model, its data).
    """
    outdir = Path(outdir)
    if not os.path.lexists(outdir):
        return
    if not overwrite:
        raise InputError(f"{outdir} exists (use --force to replace it)")
    if outdir.is_symlink():
        raise InputError(f"--force: {outdir} is a symlink; give the package folder itself")
    if not outdir.is_dir():
        raise InputError(f"--force: {outdir} is not a folder; --force replaces only a previous package")
    real = outdir.resolve()
    for src in sources:
        if _is_within(Path(src).resolve(), real):
            raise InputError(f"--force: {outdir} holds the source {src}; write the package elsewhere")
    if _is_within(Path.cwd().resolve(), real):
        raise InputError(f"--force: {outdir} is the working directory or a folder above it")
    if real == Path(real.anchor) or real == Path.home().resolve():
        raise InputError(f"--force: refusing to replace {outdir}")
    if not any(outdir.iterdir()):
        return
    if not (outdir / MANIFEST_FILE).is_file():
        raise InputError(f"--force: {outdir} is not a tinyserve package (no {MANIFEST_FILE}) and not empty; "
                         "nothing was touched")
    try:
        Manifest.load(outdir)
    except (PackageError, OSError, ValueError) as e:
        raise InputError(f"--force: {outdir} is not a valid tinyserve package ({str(e).splitlines()[0]}); "
                         "nothing was touched") from None


def staging_dir(outdir: Path) -> Path:
    """A fresh temporary folder beside ``outdir`` (same file system, so the swap is renames)."""
    outdir = Path(outdir)
    outdir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{outdir.name}.new.", dir=outdir.parent))


def swap_in(new: Path, outdir: Path) -> None:
    """Move ``new`` to ``outdir``; a folder already there is moved aside first and deleted
    only once the new one is in place (moved back if that fails)."""
    new, outdir = Path(new), Path(outdir)
    if not os.path.lexists(outdir):
        os.replace(new, outdir)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{outdir.name}.old.", dir=outdir.parent))
    aside.rmdir()  # a free name on the same file system
    os.replace(outdir, aside)
    try:
        os.replace(new, outdir)
    except BaseException:
        os.replace(aside, outdir)
        raise
    shutil.rmtree(aside, ignore_errors=True)


__all__ = ["check_output", "staging_dir", "swap_in"]
