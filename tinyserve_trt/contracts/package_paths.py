"""Paths a package names, confined to the package: the one place that resolves them.

A package is untrusted input (STYLE principle 15). Every file it names - the manifest's
``ort_optimized.file`` / ``.weights``, ``engine.file``, ``cold_tier.calibration.file``, a
calibration artifact's ``arrays``, and the fixed names the runtime opens (``model.onnx``,
the tokenizer files) - goes through :func:`resolve_inside`, which refuses an absolute path,
a ``..`` component, and a name whose resolved path (links followed) leaves the package
directory. :func:`check_name` is the part that needs no directory (the manifest's own
``__post_init__`` checks). Both raise one line naming the field.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath, PureWindowsPath


class PackageError(ValueError):
    """A package directory that is missing, incomplete or inconsistent."""


def check_name(name, field: str, error: type[ValueError] = PackageError) -> str:
    """``name`` if it is a relative path with no ``..`` component (``/``-separated); else
    ``error`` naming ``field``. Does not look at the file system."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise error(f"{field} must be a relative file name inside the package, got {name!r}")
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).anchor:
        raise error(f"{field} must be a relative file name inside the package, got the absolute path {name!r}")
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        raise error(f"{field} must be a file name inside the package, got {name!r} (with a '..' component)")
    return name


def resolve_inside(root: str | Path, name, field: str, error: type[ValueError] = PackageError) -> Path:
    """``root / name`` after :func:`check_name`, when its real path (every link followed; the
    file need not exist) is inside ``root``'s real path; else ``error`` naming ``field``. Returns
    the path as spelled under ``root`` (not the resolved one), so messages read as the user's."""
    check_name(name, field, error)
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, name))
    if os.path.commonpath([real_root, real]) != real_root:
        raise error(f"{field} {name!r} resolves to {real}, outside the package {real_root}")
    return Path(root) / name
