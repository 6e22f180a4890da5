"""ReuseIndex: what a store tier holds, and which entry to evict, by measured reuse.

Each entry keeps a hit count that decays with age: its score now is
``hits * 0.5 ** ((now - last) / half_life_s)``, ``last`` being its latest use (a write
is a use, so a new entry starts at 1). Eviction takes the lowest score: a page read
many times recently outlives one written once, however recent - plain LRU would evict
a system prompt every request shares as soon as a burst of one-off prompts passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Use:
    nbytes: int
    hits: float
    last: float


class ReuseIndex:
    """Entries by page hash with their sizes and decayed hit counts. ``clock``: seconds."""

    def __init__(self, half_life_s: float = 600.0, clock: Callable[[], float] = time.time):
        if not isinstance(half_life_s, (int, float)) or not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s!r}")
        self.half_life_s, self.clock = float(half_life_s), clock
        self._uses: dict[bytes, _Use] = {}
        self.nbytes = 0

    def __contains__(self, page_hash: bytes) -> bool:
        return page_hash in self._uses

    def __len__(self) -> int:
        return len(self._uses)

    def hashes(self) -> list[bytes]:
        return list(self._uses)

    def add(self, page_hash: bytes, nbytes: int, last: float | None = None, hits: float = 1.0) -> None:
        """Track a new entry (or replace one), used at ``last`` (default now)."""
        self.remove(page_hash)
        self._uses[page_hash] = _Use(int(nbytes), float(hits), self.clock() if last is None else float(last))
        self.nbytes += int(nbytes)

    def remove(self, page_hash: bytes) -> bool:
        use = self._uses.pop(page_hash, None)
        if use is not None:
            self.nbytes -= use.nbytes
        return use is not None

    def hit(self, page_hash: bytes) -> None:
        """Count one use now (decaying the count so far)."""
        use = self._uses.get(page_hash)
        if use is not None:
            now = self.clock()
            use.hits, use.last = self.score(page_hash, now) + 1.0, now

    def score(self, page_hash: bytes, now: float | None = None) -> float:
        use = self._uses[page_hash]
        age = max(0.0, (self.clock() if now is None else now) - use.last)
        return use.hits * 0.5 ** (age / self.half_life_s)

    def victims(self, need: int, budget: int, keep: bytes | None = None) -> list[bytes]:
        """Lowest-score entries to drop so that ``need`` more bytes fit ``budget`` (oldest first
        among equal scores); ``keep`` is never chosen. Changes nothing."""
        over = self.nbytes + need - budget
        if over <= 0:
            return []
        now = self.clock()
        order = sorted((h for h in self._uses if h != keep),
                       key=lambda h: (self.score(h, now), self._uses[h].last))
        out = []
        for h in order:
            if over <= 0:
                break
            out.append(h)
            over -= self._uses[h].nbytes
        return out
