"""DiskPageStore: one file per page entry under ``directory/<identity>/``, shareable by processes.

Layout: ``<directory>/<identity digest hex>/<first hash byte hex>/<page hash hex>.kvp``, each
file one entry (``block``: header with magic, version, identity, length, checksum; payload).

- Publish: the entry is written to ``<name>.tmp`` opened with O_EXCL - the one writer of that
  entry; another process finding the temp file skips its own write (a temp file older than
  ``stale_s`` is a crashed writer's, and is replaced) - then ``os.replace``d into place, so a
  reader sees no entry or a whole one. Two replicas writing the same hash never corrupt it.
- Index: at start the directory is scanned and every header checked (magic, version,
  identity, length against the file size: a truncated or foreign entry is dropped with one
  warning). A lookup that misses the index checks the file (read-through: another replica may
  have published it since), and a size-bound eviction rescans first.
- Reads verify the whole entry (``block.decode``: checksum); a bad one is dropped (warning,
  file removed) and never served.
- Bound: ``max_bytes``; past it the lowest-reuse entries are removed, down to 90% of it
  (``reuse.ReuseIndex``; the recency of an entry found at a scan is its file's mtime, refreshed on every hit).
- A write that fails (ENOSPC, any OSError) is skipped with a warning; nothing else changes.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from tinyserve_trt.runtime.kvstore.base import PageStore
from tinyserve_trt.runtime.kvstore.block import (
    HEADER_SIZE,
    BadEntry,
    PageBlock,
    check_header,
    decode,
    encode,
)
from tinyserve_trt.runtime.kvstore.identity import StoreIdentity
from tinyserve_trt.runtime.kvstore.reuse import ReuseIndex

log = logging.getLogger("tinyserve.kvstore")
SUFFIX = ".kvp"


class DiskPageStore(PageStore):
    """Entries of ``identity`` under ``directory``, at most ``max_bytes`` of them."""

    tier = "disk"

    def __init__(self, identity: StoreIdentity, directory, max_bytes: int, half_life_s: float = 600.0,
                 stale_s: float = 60.0, clock=None):
        super().__init__(identity)
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.max_bytes, self.stale_s = max_bytes, stale_s
        self.root = Path(directory) / identity.digest.hex()
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise ValueError(f"kv cache dir {directory}: cannot create it ({e.strerror or e})") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ValueError(f"kv cache dir {self.root} is not writable")
        self._index = ReuseIndex(half_life_s, **({"clock": clock} if clock else {}))
        self.scan()

    # ---- index ------------------------------------------------------------------
    def path(self, page_hash: bytes) -> Path:
        hx = page_hash.hex()
        return self.root / hx[:2] / (hx + SUFFIX)

    def scan(self) -> None:
        """(Re)build the index from the directory: headers checked, bad entries dropped."""
        seen = set()
        for path in self.root.glob(f"*/*{SUFFIX}"):
            try:
                page_hash = bytes.fromhex(path.name[:-len(SUFFIX)])
            except ValueError:
                continue  # not a name we write
            if len(page_hash) != 16:
                continue
            seen.add(page_hash)
            if page_hash not in self._index:
                self._load_header(page_hash)
        for h in self._index.hashes():
            if h not in seen:  # removed by another process
                self._index.remove(h)

    def _load_header(self, page_hash: bytes) -> bool:
        """Index the file of ``page_hash`` if its header is sound; drop it if not."""
        path = self.path(page_hash)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                head = f.read(HEADER_SIZE)
        except FileNotFoundError:
            return False
        except OSError as e:
            log.warning("kv store: cannot read %s (%s); not served", path, e)
            return False
        try:
            check_header(head, page_hash, self.identity, total=st.st_size)
        except BadEntry as e:
            self._drop(page_hash, str(e))
            return False
        self._index.add(page_hash, st.st_size, last=st.st_mtime)
        return True

    def _drop(self, page_hash: bytes, why: str) -> None:
        path = self.path(page_hash)
        log.warning("kv store: dropped entry %s: %s", path, why)
        self.counters["dropped"] += 1
        self._index.remove(page_hash)
        try:
            path.unlink()
        except OSError:
            pass

    @property
    def nbytes(self) -> int:
        return self._index.nbytes

    @property
    def num_entries(self) -> int:
        return len(self._index)

    # ---- reads ------------------------------------------------------------------
    def contains(self, page_hash: bytes) -> bool:
        return page_hash in self._index or self._load_header(page_hash)  # read-through: another writer

    def get_many(self, hashes: Sequence[bytes]) -> list[tuple[PageBlock, str]]:
        out = []
        for h in hashes:
            block = self._read(h)
            if block is None:
                self.counters["misses"] += 1
                break
            out.append((block, self.tier))
        return out

    def _read(self, page_hash: bytes) -> PageBlock | None:
        if not self.contains(page_hash):
            return None
        path = self.path(page_hash)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:  # evicted by another process since
            self._index.remove(page_hash)
            return None
        except OSError as e:
            log.warning("kv store: cannot read %s (%s); not served", path, e)
            return None
        try:
            block = decode(raw, page_hash, self.identity)
        except BadEntry as e:
            self._drop(page_hash, str(e))
            return None
        self._index.hit(page_hash)
        try:
            os.utime(path)  # its recency survives a restart
        except OSError:
            pass
        self.counters["hits"] += 1
        self.counters["hit_bytes"] += len(raw)
        return block

    # ---- writes -----------------------------------------------------------------
    def put(self, page_hash: bytes, block: PageBlock) -> bool:
        path = self.path(page_hash)
        if page_hash in self._index or path.exists():
            return False
        data = encode(block, page_hash, self.identity)
        if len(data) > self.max_bytes:
            self.counters["skipped"] += 1
            return False
        if self._index.nbytes + len(data) > self.max_bytes:
            self.scan()  # other writers' entries count too
            # down to 90% of the bound: a scan and a sort per tenth of the store, not per write
            for victim in self._index.victims(len(data), int(self.max_bytes * 0.9), keep=page_hash):
                self._index.remove(victim)
                try:
                    self.path(victim).unlink()
                except OSError:
                    pass
                self.counters["evicted"] += 1
        if not self._publish(path, data):
            self.counters["skipped"] += 1
            return False
        self._index.add(page_hash, len(data))
        self.counters["puts"] += 1
        self.counters["put_bytes"] += len(data)
        return True

    def _publish(self, path: Path, data: bytes) -> bool:
        """Write ``data`` to ``path`` atomically as its one writer; False (warned) if not written."""
        tmp = path.with_name(path.name + ".tmp")
        try:
            path.parent.mkdir(exist_ok=True, mode=0o700)
            fd = self._open_exclusive(tmp)
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

    def _open_exclusive(self, tmp: Path) -> int | None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            return os.open(tmp, flags, 0o600)
        except FileExistsError:
            try:
                stale = time.time() - tmp.stat().st_mtime > self.stale_s
            except FileNotFoundError:
                stale = True
            if not stale:
                return None
            try:
                tmp.unlink()
                return os.open(tmp, flags, 0o600)
            except (FileExistsError, FileNotFoundError):
                return None
