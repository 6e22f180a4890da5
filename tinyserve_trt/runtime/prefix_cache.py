"""Prefix cache: reuse the K/V pages of a prompt prefix another sequence computed.

Swap point: ``PrefixCache`` ABC + ``PREFIX_CACHES`` registry + ``make_prefix_cache``.
  hash  full pages keyed by a chained hash (nano-vllm ``compute_hash``), confirmed by
        exact token equality
  none  sharing off
Only full pages whose K/V are written are registered, so a match never returns a
page still being computed. Cached pages with no holder stay in the pool's LRU and
are evicted there when it needs room; the pool tells us through a callback.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tinyserve_trt.runtime.pages import PagePool, PoolIntegrityError


class PrefixCache(ABC):
    """Finds and registers full pages of token prefixes in a :class:`PagePool`."""

    def __init__(self, pool: PagePool):
        self.pool = pool

    @abstractmethod
    def match(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """Pages holding the longest cached run of full pages that prefixes ``token_ids``.

        Returns (pages, chain hashes), one per matched page; each page is incref'd
        for the caller, who owns those references. Reads only whole pages of
        ``token_ids`` (a trailing partial page never matches).
        """

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

    @property
    def num_entries(self) -> int:
        return 0


PREFIX_CACHES: dict[str, type[PrefixCache]] = {}


def register_prefix_cache(name: str):
    def deco(cls: type[PrefixCache]) -> type[PrefixCache]:
        PREFIX_CACHES[name] = cls
        return cls
    return deco


def make_prefix_cache(name: str, pool: PagePool) -> PrefixCache:
    """The prefix cache registered as ``name`` over ``pool``; ValueError if unknown."""
    if name not in PREFIX_CACHES:
        raise ValueError(f"unknown prefix cache {name!r}; choose from {sorted(PREFIX_CACHES)}")
    return PREFIX_CACHES[name](pool)


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

    def match(self, token_ids):
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

    def __init__(self, pool: PagePool):
        super().__init__(pool)
        self._page_by_hash: dict[bytes, int] = {}
        self._entry_by_page: dict[int, _Entry] = {}
        pool.set_evict_callback(self._forget)

    @property
    def num_entries(self) -> int:
        return len(self._page_by_hash)

    def match(self, token_ids):
        ps = self.pool.page_size
        pages, hashes, parent = [], [], None
        for start in range(0, len(token_ids) - ps + 1, ps):
            chunk = tuple(token_ids[start:start + ps])
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
        for page in pages:
            self.pool.incref(page)
        return pages, hashes

    def insert(self, token_ids, pages, hashes):
        ps = self.pool.page_size
        hashes = list(hashes)
        for i in range(len(hashes), len(token_ids) // ps):
            chunk = tuple(token_ids[i * ps:(i + 1) * ps])
            parent = hashes[-1] if hashes else None
            h = compute_hash(chunk, parent)
            page = pages[i]
            if h not in self._page_by_hash and page not in self._entry_by_page:
                self._page_by_hash[h] = page
                self._entry_by_page[page] = _Entry(h, parent, chunk)
                self.pool.mark_cached(page)
            hashes.append(h)
        return hashes

    def discard(self, page):
        if page in self._entry_by_page:
            self._forget(page)
            self.pool.unmark_cached(page)

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
