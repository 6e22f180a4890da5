"""HostPageStore: pages in host memory up to a byte budget, demoted to a lower store past it.

The pool's evicted pages land here first (a memory copy). When the budget is exceeded the
lowest-reuse entries (``reuse.ReuseIndex``) leave: into ``lower`` (a ``DiskPageStore``)
when there is one, else dropped. A read that misses here continues in ``lower``; pages
read from there are not copied back (they go into the pool, which is where they are used).
Entries here were built by this process from its own pool: they are trusted, not re-verified.
Thread-safe: the engine's thread puts while the prefetcher's (``prefetch.py``) reads; a read from
``lower`` runs outside this store's lock, so a disk read never holds up an eviction's put.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from tinyserve_trt.runtime.kvstore.base import PageStore
from tinyserve_trt.runtime.kvstore.block import PageBlock, check_block
from tinyserve_trt.runtime.kvstore.identity import StoreIdentity
from tinyserve_trt.runtime.kvstore.reuse import ReuseIndex

log = logging.getLogger("tinyserve.kvstore")


class HostPageStore(PageStore):
    """``max_bytes`` of entries in memory (0: none kept - everything goes straight to ``lower``)."""

    tier = "host"

    def __init__(self, identity: StoreIdentity, max_bytes: int, lower: PageStore | None = None,
                 half_life_s: float = 600.0, clock=None):
        super().__init__(identity)
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        if lower is not None and lower.identity != identity:
            raise ValueError("the lower store holds another identity's pages")
        self.max_bytes, self.lower = max_bytes, lower
        self._blocks: dict[bytes, PageBlock] = {}
        self._index = ReuseIndex(half_life_s, **({"clock": clock} if clock else {}))
        self._lock = threading.RLock()  # entries, index and counters

    @property
    def nbytes(self) -> int:
        return self._index.nbytes

    @property
    def num_entries(self) -> int:
        return len(self._blocks)

    def contains(self, page_hash: bytes) -> bool:
        with self._lock:
            if page_hash in self._blocks:
                return True
        return self.lower is not None and self.lower.contains(page_hash)

    def get_many(self, hashes: Sequence[bytes]) -> list[tuple[PageBlock, str]]:
        out: list[tuple[PageBlock, str]] = []
        below: list[bytes] = []  # a run of hashes not here, read from ``lower`` in one pass
        for h in [*hashes, None]:
            if below and (h is None or self._has(h)):
                got = self.lower.get_many(below)  # outside the lock: disk I/O
                out += got
                if len(got) < len(below):
                    return out
                below = []
            if h is None:
                break
            block = self._hit(h)  # None also when demoted since _has: then it is below
            if block is None:
                if self.lower is None:
                    with self._lock:
                        self.counters["misses"] += 1
                    return out
                below.append(h)
                continue
            out.append((block, self.tier))
        return out

    def _has(self, page_hash: bytes) -> bool:
        with self._lock:
            return page_hash in self._blocks

    def _hit(self, page_hash: bytes) -> PageBlock | None:
        """The entry of ``page_hash`` here (counted as a hit), or None."""
        with self._lock:
            block = self._blocks.get(page_hash)
            if block is not None:
                self._index.hit(page_hash)
                self.counters["hits"] += 1
                self.counters["hit_bytes"] += block.nbytes
            return block

    def put(self, page_hash: bytes, block: PageBlock) -> bool:
        check_block(block, self.identity)
        with self._lock:
            return self._put(page_hash, block)

    def _put(self, page_hash: bytes, block: PageBlock) -> bool:
        if page_hash in self._blocks:
            self._index.hit(page_hash)
            return False
        size = block.nbytes
        if size > self.max_bytes:  # no room here at all: straight down
            return self._demote(page_hash, block)
        for victim in self._index.victims(size, self.max_bytes):
            self._index.remove(victim)
            self._demote(victim, self._blocks.pop(victim))
            self.counters["evicted"] += 1
        self._blocks[page_hash] = block
        self._index.add(page_hash, size)
        self.counters["puts"] += 1
        self.counters["put_bytes"] += size
        return True

    def _demote(self, page_hash: bytes, block: PageBlock) -> bool:
        if self.lower is None:
            self.counters["skipped"] += 1
            return False
        self.counters["demoted"] += 1
        return self.lower.put(page_hash, block)

    def drain(self) -> int:
        """Demote every entry to ``lower`` (at close: what stays in memory dies with the process);
        returns how many were written there."""
        if self.lower is None:
            return 0
        with self._lock:
            return sum(bool(self.lower.put(h, b)) for h, b in self._blocks.items())

    def stats(self) -> dict:
        return {**super().stats(), **(self.lower.stats() if self.lower is not None else {})}

    def wait(self) -> None:
        if self.lower is not None:
            self.lower.wait()

    def close(self) -> None:
        if self.lower is not None:
            self.lower.close()
