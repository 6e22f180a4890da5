"""Prefix cache: reuse the K/V pages of a prompt prefix another sequence computed.

Swap point: ``PrefixCache`` ABC + ``PREFIX_CACHES`` registry + ``make_prefix_cache``.
  hash  full pages keyed by a chained hash (nano-vllm ``compute_hash``), confirmed by
        exact token equality
  none  sharing off
Only full pages whose K/V are written are registered, so a match never returns a
page still being computed. Cached pages with no holder stay in the pool's LRU and
are evicted there when it needs room; the pool tells us through a callback.

With a page store (``runtime/kvstore``, issue #33) below the pool, an evicted page's content
goes to the store first (and, ``write_through``, every page as it is registered; :meth:`flush`
writes the cached ones at close), and a match continues the chain in the store where the
pool's pages end: the run of stored pages is read in one pass, then allocated and filled in
one ``allocate(fill=...)`` transaction and registered like computed pages - so the prefill
skips them. A store that fails costs only the reuse: the match stops there.

Prefetch (``kvstore/prefetch.py``): :meth:`PrefixCache.prefetch` (the scheduler calls it when a
request is queued) starts reading, on a background thread, the stored pages a match would read
now; :meth:`PrefixCache.match` given that handle takes the pages read and only copies them into
the pool (reading synchronously what the prefetch did not get).
"""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tinyserve_trt.runtime.kvstore.pool_io import page_block, restore_page
from tinyserve_trt.runtime.pages import PagePool, PoolIntegrityError

log = logging.getLogger("tinyserve.kvstore")


class PrefixCache(ABC):
    """Finds and registers full pages of token prefixes in a :class:`PagePool`."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        # pages of the latest match by where they came from (``pool``, ``host``, ``disk``)
        self.last_match_tiers: dict[str, int] = {}

    @abstractmethod
    def match(self, token_ids: Sequence[int], prefetch=None) -> tuple[list[int], list[bytes]]:
        """Pages holding the longest cached run of full pages that prefixes ``token_ids``.

        Returns (pages, chain hashes), one per matched page; each page is incref'd
        for the caller, who owns those references. Reads only whole pages of
        ``token_ids`` (a trailing partial page never matches). ``prefetch``: the handle
        :meth:`prefetch` gave for these ``token_ids`` (taken here: do not drop it after).
        """

    def prefetch(self, token_ids: Sequence[int]):
        """Start reading, in the background, the stored pages a :meth:`match` of ``token_ids``
        would read now; a handle for ``match`` (or :meth:`drop_prefetch`), or None when there is
        nothing to read. Changes nothing in the pool. None by default (no store)."""

    def drop_prefetch(self, prefetch) -> None:
        """Forget a :meth:`prefetch` handle that no match will take (its request left)."""

    def close(self) -> None:
        """Stop background work (the prefetcher) before the store below closes."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], pages: Sequence[int], hashes: Sequence[bytes]) -> list[bytes]:
        """Register the full pages of ``token_ids`` beyond ``len(hashes)``.

        ``token_ids`` are tokens whose K/V are already written in ``pages``.
        Returns the extended hash chain. A page whose content is cached already
        (another page) stays private and is freed normally.
        """

    @abstractmethod
    def discard(self, page: int) -> None:
        """Forget ``page`` (its only holder is about to write into it)."""

    def check_integrity(self) -> None:
        """Raise PoolIntegrityError if the cache disagrees with the pool."""

    def flush(self) -> int:
        """Write cached pages the page store lacks (at close); how many. Nothing without a store."""
        return 0

    @property
    def num_entries(self) -> int:
        return 0


PREFIX_CACHES: dict[str, type[PrefixCache]] = {}


def register_prefix_cache(name: str):
    def deco(cls: type[PrefixCache]) -> type[PrefixCache]:
        PREFIX_CACHES[name] = cls
        return cls
    return deco


def make_prefix_cache(name: str, pool: PagePool, **options) -> PrefixCache:
    """The prefix cache registered as ``name`` over ``pool`` (``options``: ``hash``'s
    ``store``, ``write_through``); ValueError if unknown."""
    if name not in PREFIX_CACHES:
        raise ValueError(f"unknown prefix cache {name!r}; choose from {sorted(PREFIX_CACHES)}")
    if options and name == "none":
        raise ValueError("a page store needs prefix sharing (prefix cache 'hash')")
    return PREFIX_CACHES[name](pool, **options)


def compute_hash(token_ids: Sequence[int], parent: bytes | None) -> bytes:
    """128-bit chained hash of one page's tokens after the page whose hash is ``parent``."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(np.asarray(token_ids, np.int64).tobytes())
    return h.digest()


@dataclass(frozen=True)
class _Entry:
    hash: bytes
    parent: bytes | None
    tokens: tuple[int, ...]


@register_prefix_cache("none")
class NoPrefixCache(PrefixCache):
    """Sharing off: nothing matches, nothing is kept."""

    def match(self, token_ids, prefetch=None):
        return [], []

    def insert(self, token_ids, pages, hashes):
        return list(hashes)

    def discard(self, page):
        pass


@register_prefix_cache("hash")
class HashPrefixCache(PrefixCache):
    """Full pages keyed by ``compute_hash(tokens, parent hash)``, checked token by token.

    The chain makes a page's key depend on the whole prefix; storing each page's
    tokens and parent hash turns a hash hit into an exact match of this page, and,
    walking from the first page, of the prefix (up to a 128-bit collision of a parent).
    """

    def __init__(self, pool: PagePool, store=None, write_through: bool = False, prefetch: bool = True):
        """``store``: a ``kvstore.PageStore`` of this pool's identity below the pool, or None;
        ``write_through``: store every page when it is registered (shared stores: another
        replica can use it at once), not only when the pool evicts it; ``prefetch``: read a
        queued request's stored pages on a background thread (``kvstore.prefetch``), at most
        a pool's worth held."""
        super().__init__(pool)
        self.store, self.write_through = store, bool(write_through)
        self.prefetcher = None
        if store is not None and prefetch:
            from tinyserve_trt.runtime.kvstore.prefetch import Prefetcher

            self.prefetcher = Prefetcher(store, max_pages=pool.num_pages)
        self._page_by_hash: dict[bytes, int] = {}
        self._entry_by_page: dict[int, _Entry] = {}
        pool.set_evict_callback(self._evicted)

    @property
    def num_entries(self) -> int:
        return len(self._page_by_hash)

    def _chunks(self, token_ids) -> list[tuple]:
        ps = self.pool.page_size
        return [tuple(token_ids[s:s + ps]) for s in range(0, len(token_ids) - ps + 1, ps)]

    def _pool_run(self, chunks) -> tuple[list[int], list[bytes], bytes | None]:
        """The leading pages of ``chunks`` cached in the pool, their hashes, the last hash."""
        pages, hashes, parent = [], [], None
        for chunk in chunks:
            h = compute_hash(chunk, parent)
            page = self._page_by_hash.get(h)
            if page is None:
                break
            entry = self._entry_by_page[page]
            if entry.tokens != chunk or entry.parent != parent:
                break  # hash collision: not our prefix
            pages.append(page)
            hashes.append(h)
            parent = h
        return pages, hashes, parent

    def prefetch(self, token_ids):
        if self.prefetcher is None:
            return None
        chunks = self._chunks(token_ids)
        pages, _, parent = self._pool_run(chunks)
        wanted = []
        for chunk in chunks[len(pages):]:
            parent = compute_hash(chunk, parent)
            wanted.append(parent)
        return self.prefetcher.submit(wanted)  # the worker checks which the store holds

    def drop_prefetch(self, prefetch):
        if prefetch is not None and self.prefetcher is not None:
            self.prefetcher.drop(prefetch)

    def close(self):
        if self.prefetcher is not None:
            self.prefetcher.close()

    def match(self, token_ids, prefetch=None):
        chunks = self._chunks(token_ids)
        pages, hashes, parent = self._pool_run(chunks)
        for page in pages:
            self.pool.incref(page)
        self.last_match_tiers = {"pool": len(pages)} if pages else {}
        prefetched = self.prefetcher.take(prefetch) if prefetch is not None and self.prefetcher else {}
        if self.store is not None and len(pages) < len(chunks):
            more, more_hashes, tiers = self._from_store(chunks[len(pages):], parent, prefetched)
            pages, hashes = pages + more, hashes + more_hashes
            for tier, n in tiers.items():
                self.last_match_tiers[tier] = self.last_match_tiers.get(tier, 0) + n
        return pages, hashes

    def _from_store(self, chunks, parent, prefetched=None):
        """Continue a match in the store: (pages allocated, filled and registered, their hashes,
        pages per tier). Reads the whole run first (one pass; ``prefetched``: pages by hash a
        prefetch already read, used as they are), then one allocate transaction."""
        prefetched = prefetched or {}
        run = []
        for chunk in chunks[:self.pool.num_available]:  # never more than the pool can take
            h = compute_hash(chunk, parent)
            if h in self._page_by_hash or not (h in prefetched or self.store.contains(h)):
                break
            run.append((h, chunk, parent))
            parent = h
        if not run:
            return [], [], {}
        got = []
        for h, _, _ in run:  # the prefetched lead of the run
            if h not in prefetched:
                break
            got.append(prefetched[h])
        if len(got) < len(run):
            try:
                got += self.store.get_many([h for h, _, _ in run[len(got):]])
            except Exception as e:  # a store that fails costs the reuse, never the request
                log.warning("kv store: read failed (%r); recomputing", e)
                if not got:
                    return [], [], {}
        blocks = []
        for (h, chunk, par), (block, tier) in zip(run, got):
            if tuple(block.tokens.tolist()) != chunk or block.parent != par:
                break  # a hash collision in the store: not our prefix
            blocks.append((h, chunk, par, block, tier))
        if not blocks:
            return [], [], {}

        def fill(new_pages):
            for page, (_, _, _, block, _) in zip(new_pages, blocks):
                restore_page(self.pool, page, block)

        try:
            new = self.pool.allocate(len(blocks), fill=fill)
        except Exception as e:  # undone by the pool
            log.warning("kv store: restoring %d pages failed (%r); recomputing", len(blocks), e)
            return [], [], {}
        tiers: dict[str, int] = {}
        for page, (h, chunk, par, _, tier) in zip(new, blocks):
            self._register(h, page, par, chunk)
            tiers[tier] = tiers.get(tier, 0) + 1
        return new, [b[0] for b in blocks], tiers

    def _register(self, h: bytes, page: int, parent: bytes | None, chunk: tuple) -> None:
        self._page_by_hash[h] = page
        self._entry_by_page[page] = _Entry(h, parent, chunk)
        self.pool.mark_cached(page)

    def insert(self, token_ids, pages, hashes):
        ps = self.pool.page_size
        hashes = list(hashes)
        for i in range(len(hashes), len(token_ids) // ps):
            chunk = tuple(token_ids[i * ps:(i + 1) * ps])
            parent = hashes[-1] if hashes else None
            h = compute_hash(chunk, parent)
            page = pages[i]
            if h not in self._page_by_hash and page not in self._entry_by_page:
                self._register(h, page, parent, chunk)
                if self.write_through:
                    self._store(page)
            hashes.append(h)
        return hashes

    def discard(self, page):
        if page in self._entry_by_page:
            self._forget(page)
            self.pool.unmark_cached(page)

    def _evicted(self, page: int) -> None:
        """The pool evicts ``page`` (its data still intact): to the store, then forgotten."""
        if self.store is not None and not self.write_through:
            self._store(page)
        self._forget(page)

    def _store(self, page: int) -> bool:
        """Put cached ``page`` in the store. Never raises: the pool calls this mid-allocation."""
        entry = self._entry_by_page[page]
        try:
            if self.store.contains(entry.hash):
                return False
            block = page_block(self.pool, page, entry.tokens, entry.parent)
            return block is not None and self.store.put(entry.hash, block)
        except Exception as e:
            log.warning("kv store: page not stored (%r)", e)
            return False

    def flush(self) -> int:
        if self.store is None:
            return 0
        n = sum(self._store(page) for page in list(self._entry_by_page))
        drain = getattr(self.store, "drain", None)  # what sits in host memory goes down too
        return n + (drain() if drain is not None else 0)

    def _forget(self, page: int) -> None:
        entry = self._entry_by_page.pop(page)
        del self._page_by_hash[entry.hash]

    def check_integrity(self):
        def fail(msg):
            raise PoolIntegrityError(f"prefix cache integrity: {msg}")

        if len(self._page_by_hash) != len(self._entry_by_page):
            fail(f"{len(self._page_by_hash)} hashes but {len(self._entry_by_page)} pages")
        for h, page in self._page_by_hash.items():
            entry = self._entry_by_page.get(page)
            if entry is None or entry.hash != h:
                fail(f"hash of page {page} maps inconsistently")
            if len(entry.tokens) != self.pool.page_size:
                fail(f"page {page} cached with {len(entry.tokens)} tokens")
            if compute_hash(entry.tokens, entry.parent) != h:
                fail(f"page {page} hash does not match its tokens")
        marked = set(self.pool.cached_pages())
        if marked != set(self._entry_by_page):
            fail(f"pool marks {len(marked)} pages cached, cache holds {len(self._entry_by_page)}")
