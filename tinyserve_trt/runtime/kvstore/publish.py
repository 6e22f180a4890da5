"""Atomic publication of one store entry by its one writer (``DiskPageStore``).

The entry is written to ``<name>.tmp`` opened with O_EXCL - whoever creates it is the entry's
one writer; a process finding it skips its own write, unless it is older than ``stale_s``
(a crashed writer's), which is replaced - then ``os.replace``d into place: readers see no
entry or a whole one, and two processes writing the same entry never interleave.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("tinyserve.kvstore")


def publish(path: Path, data: bytes, stale_s: float = 60.0) -> bool:
    """Write ``data`` to ``path`` atomically as its one writer; False (warned) if not written:
    another writer holds it, or the write failed (ENOSPC or any OSError: the temp file is removed)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(exist_ok=True, mode=0o700)
        fd = _open_exclusive(tmp, stale_s)
        if fd is None:
            return False  # another writer is publishing this entry
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
    except OSError as e:
        what = "disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
        log.warning("kv store: page %s not stored (%s)", path.name, what)
        return False
    return True


def _open_exclusive(tmp: Path, stale_s: float) -> int | None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        return os.open(tmp, flags, 0o600)
    except FileExistsError:
        try:
            stale = time.time() - tmp.stat().st_mtime > stale_s
        except FileNotFoundError:
            stale = True
        if not stale:
            return None
        try:
            tmp.unlink()
            return os.open(tmp, flags, 0o600)
        except (FileExistsError, FileNotFoundError):
            return None
