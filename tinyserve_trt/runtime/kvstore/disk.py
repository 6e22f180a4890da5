"""DiskPageStore: one file per page entry under ``directory/<identity>/``, shareable by processes.

Layout: ``<directory>/<identity digest hex>/<first hash byte hex>/<page hash hex>.kvp``, each
file one entry (``block``: header with magic, version, identity, length, checksum; payload).

- Publish: ``publish.publish`` - an O_EXCL temp file (one writer per entry), then ``os.replace``:
  a reader sees no entry or a whole one; two replicas writing the same hash never corrupt it.
  With ``background`` a writer thread encodes and publishes, off the engine's step.
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

import logging
import os
import queue
import threading
from collections.abc import Sequence
from pathlib import Path

from tinyserve_trt.runtime.kvstore.base import PageStore
from tinyserve_trt.runtime.kvstore.block import (
    HEADER_SIZE,
    BadEntry,
    PageBlock,
    check_block,
    check_header,
    decode,
    encode,
)
from tinyserve_trt.runtime.kvstore.identity import StoreIdentity
from tinyserve_trt.runtime.kvstore.publish import publish
from tinyserve_trt.runtime.kvstore.reuse import ReuseIndex

log = logging.getLogger("tinyserve.kvstore")
SUFFIX = ".kvp"


class DiskPageStore(PageStore):
    """Entries of ``identity`` under ``directory``, at most ``max_bytes`` of them."""

    tier = "disk"

    def __init__(self, identity: StoreIdentity, directory, max_bytes: int, half_life_s: float = 600.0,
                 stale_s: float = 60.0, clock=None, background: bool = False, max_pending: int = 256):
        """``background``: entries are encoded and written by a writer thread (the engine's step
        does not wait for the disk); at most ``max_pending`` wait, then ``put`` blocks."""
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
        self._lock = threading.RLock()  # the index and counters: the engine's thread and the writer's
        self._pending: dict[bytes, PageBlock] = {}  # queued for the writer, served from here meanwhile
        self._queue = queue.Queue(maxsize=max_pending) if background else None
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._writer, name="kv-store-writer", daemon=True)
            self._thread.start()
        self.scan()

    # ---- index ------------------------------------------------------------------
    def path(self, page_hash: bytes) -> Path:
        hx = page_hash.hex()
        return self.root / hx[:2] / (hx + SUFFIX)

    def scan(self) -> None:
        """(Re)build the index from the directory: headers checked, bad entries dropped."""
        with self._lock:
            self._scan()

    def _scan(self) -> None:
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
        with self._lock:  # read-through on a miss: another process may have published it
            return page_hash in self._pending or page_hash in self._index or self._load_header(page_hash)

    def get_many(self, hashes: Sequence[bytes]) -> list[tuple[PageBlock, str]]:
        out = []
        for h in hashes:
            block = self._read(h)
            if block is None:
                with self._lock:
                    self.counters["misses"] += 1
                break
            out.append((block, self.tier))
        return out

    def _read(self, page_hash: bytes) -> PageBlock | None:
        with self._lock:
            pending = self._pending.get(page_hash)
            if pending is not None:  # queued, not yet on disk: ours, served as it was given
                self.counters["hits"] += 1
                self.counters["hit_bytes"] += pending.nbytes
                return pending
            if not self.contains(page_hash):
                return None
        return self._read_file(page_hash)  # the I/O and the checksum outside the lock (a prefetch's)

    def _read_file(self, page_hash: bytes) -> PageBlock | None:
        path = self.path(page_hash)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:  # evicted by another process since
            with self._lock:
                self._index.remove(page_hash)
            return None
        except OSError as e:
            log.warning("kv store: cannot read %s (%s); not served", path, e)
            return None
        try:
            block = decode(raw, page_hash, self.identity)
        except BadEntry as e:
            with self._lock:
                self._drop(page_hash, str(e))
            return None
        try:
            os.utime(path)  # its recency survives a restart
        except OSError:
            pass
        with self._lock:
            self._index.hit(page_hash)
            self.counters["hits"] += 1
            self.counters["hit_bytes"] += len(raw)
        return block

    # ---- writes -----------------------------------------------------------------
    def put(self, page_hash: bytes, block: PageBlock) -> bool:
        """Background: True once queued (the writer thread publishes it; a read meanwhile is
        served from the queue); else True once published."""
        check_block(block, self.identity)
        with self._lock:
            if page_hash in self._pending or page_hash in self._index or self.path(page_hash).exists():
                return False
            if self._queue is None:
                return self._write(page_hash, block)
            self._pending[page_hash] = block
        self._queue.put(page_hash)  # blocks while max_pending entries wait: the writer sets the pace
        return True

    def _write(self, page_hash: bytes, block: PageBlock) -> bool:
        data = encode(block, page_hash, self.identity)
        with self._lock:
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
        ok = publish(self.path(page_hash), data, self.stale_s)  # I/O outside the lock
        with self._lock:
            if not ok:
                self.counters["skipped"] += 1
                return False
            self._index.add(page_hash, len(data))
            self.counters["puts"] += 1
            self.counters["put_bytes"] += len(data)
        return True

    def _writer(self) -> None:
        while True:
            page_hash = self._queue.get()
            try:
                if page_hash is None:
                    return
                self._write(page_hash, self._pending[page_hash])
            except Exception as e:  # a writer that dies would leave the queue full: log, go on
                log.warning("kv store: page %s not stored (%r)", page_hash.hex(), e)
            finally:
                with self._lock:
                    self._pending.pop(page_hash, None)
                self._queue.task_done()

    def wait(self) -> None:
        """Return once every queued entry is published (or skipped)."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        """Publish what is queued, then stop the writer thread."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
