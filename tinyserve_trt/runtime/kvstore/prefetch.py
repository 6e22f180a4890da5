"""Prefetcher: a queued request's stored pages, read on a background thread before its admission.

Without it a match reads its run of store pages (a disk read and a checksum per page) inside
the engine step that admits the request. The scheduler asks for a prefetch when a request is
queued (``PrefixCache.prefetch``); one worker thread reads the leading run of the request's
page hashes the store holds (``PageStore.get_many``: every page verified, as any read) into
host memory. At admission the prefix cache takes what was read (:meth:`Prefetcher.take`) and
only copies it into the pool:

- done: its pages are used as they are;
- still reading: admission waits for that read (never reads the same pages twice);
- still queued behind other prefetches: cancelled, and the match reads synchronously, as
  without a prefetcher;
- failed: logged, and the match reads synchronously (or, if the store fails again, the
  prefill recomputes): a prefetch can cost time, never a page or a request.

What a prefetch read is only a candidate: the match still checks every page's tokens and
parent hash against the prompt, and stops at the first that differs. At most ``max_pages``
pages are held (queued or read, not yet taken): a request past that is read at admission.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from tinyserve_trt.runtime.kvstore.base import PageStore
from tinyserve_trt.runtime.kvstore.block import PageBlock

log = logging.getLogger("tinyserve.kvstore")

THREAD_NAME = "tinyserve-kv-prefetch"
COUNTERS = ("submitted", "pages_read", "used", "waited", "cancelled", "failed", "skipped", "dropped")


class Prefetch:
    """One request's read: ``hashes`` (candidates, in chain order) and the future of its pages."""

    def __init__(self, hashes: Sequence[bytes], future: Future):
        self.hashes, self.future = tuple(hashes), future
        self.settled = False  # taken or dropped: its pages no longer count as held

    def __repr__(self) -> str:
        state = "settled" if self.settled else ("done" if self.future.done() else "pending")
        return f"Prefetch({len(self.hashes)} pages, {state})"


class Prefetcher:
    """Reads store pages ahead of admission on one worker thread (see the module docstring)."""

    def __init__(self, store: PageStore, max_pages: int):
        if not isinstance(max_pages, int) or isinstance(max_pages, bool) or max_pages < 1:
            raise ValueError(f"max_pages must be an int >= 1, got {max_pages!r}")
        self.store, self.max_pages = store, max_pages
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._held = 0  # pages of prefetches not yet settled
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None  # started on the first prefetch
        self._closed = False

    @property
    def held_pages(self) -> int:
        return self._held

    def submit(self, hashes: Sequence[bytes]) -> Prefetch | None:
        """Start reading the leading run of ``hashes`` the store holds; None when there is
        nothing to read or no room (``max_pages`` held): the match then reads at admission."""
        hashes = list(hashes)[:self.max_pages]
        if not hashes:
            return None
        with self._lock:
            if self._closed:
                return None
            if self._held + len(hashes) > self.max_pages:
                self.counters["skipped"] += 1
                return None
            self._held += len(hashes)
            self.counters["submitted"] += 1
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME)
        return Prefetch(hashes, self._executor.submit(self._read, hashes))

    def _read(self, hashes: list[bytes]) -> list[tuple[PageBlock, str]]:
        run = []
        for h in hashes:  # contains first: a page not stored is not counted as a store miss
            if not self.store.contains(h):
                break
            run.append(h)
        got = self.store.get_many(run) if run else []
        with self._lock:
            self.counters["pages_read"] += len(got)
        return got

    def take(self, prefetch: Prefetch) -> dict[bytes, tuple[PageBlock, str]]:
        """The verified pages ``prefetch`` read, by hash (waits for a read in progress); {} when
        it was still queued (cancelled here) or failed: the caller reads them itself."""
        self._settle(prefetch)
        if prefetch.future.cancel():
            self._count("cancelled")
            return {}
        if not prefetch.future.done():
            self._count("waited")
        try:
            got = prefetch.future.result()
        except Exception as e:  # the store failed in the worker: the match reads synchronously
            self._count("failed")
            log.warning("kv store: prefetch failed (%r); reading at admission", e)
            return {}
        self._count("used")
        return {h: item for h, item in zip(prefetch.hashes, got)}

    def drop(self, prefetch: Prefetch) -> None:
        """Forget ``prefetch`` (its request left before admission): cancelled if still queued."""
        if self._settle(prefetch):
            prefetch.future.cancel()
            self._count("dropped")

    def _settle(self, prefetch: Prefetch) -> bool:
        with self._lock:
            if prefetch.settled:
                return False
            prefetch.settled = True
            self._held -= len(prefetch.hashes)
            return True

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    def stats(self) -> dict:
        """Counters, keys prefixed ``prefetch_``, and the pages held now."""
        with self._lock:
            out = {f"prefetch_{k}": v for k, v in self.counters.items()}
            out["prefetch_held_pages"] = self._held
        return out

    def close(self) -> None:
        """Cancel the queued prefetches and wait for the one reading (before the store closes)."""
        with self._lock:
            self._closed, executor = True, self._executor
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
