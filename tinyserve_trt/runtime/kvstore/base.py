"""PageStore: whole KV pages by chained page hash, below the pool (swap point).

``PageStore`` ABC + ``PAGE_STORES`` registry + ``make_page_store``:
  host       entries in memory (``host.HostPageStore``)
  disk       one file per entry under a directory (``disk.DiskPageStore``)
  host+disk  memory first, entries past the memory budget demoted to disk

Every store is bound to one :class:`~tinyserve_trt.runtime.kvstore.identity.StoreIdentity`
and serves only its entries. A store never raises on a write it cannot make (full disk,
budget too small): the page is skipped, with a warning, and counted. A read returns only
verified pages; a bad entry is dropped with one warning.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from tinyserve_trt.runtime.kvstore.block import PageBlock
from tinyserve_trt.runtime.kvstore.identity import StoreIdentity

COUNTERS = ("puts", "put_bytes", "skipped", "hits", "hit_bytes", "misses", "dropped", "evicted", "demoted")


class PageStore(ABC):
    """Pages of one identity, by 16-byte chained page hash (``prefix_cache.compute_hash``)."""

    tier = "store"  # the name a hit is counted under (``host``, ``disk``)

    def __init__(self, identity: StoreIdentity):
        self.identity = identity
        self.counters = dict.fromkeys(COUNTERS, 0)

    @abstractmethod
    def contains(self, page_hash: bytes) -> bool:
        """Whether an entry for ``page_hash`` may be served (a later read still verifies it)."""

    @abstractmethod
    def get_many(self, hashes: Sequence[bytes]) -> list[tuple[PageBlock, str]]:
        """The verified pages of the leading run of ``hashes`` (one pass, in order), each with
        the tier that served it; stops at the first one missing or bad. Counts the hits."""

    @abstractmethod
    def put(self, page_hash: bytes, block: PageBlock) -> bool:
        """Store ``block`` (a full page of this identity) under ``page_hash``; False when it was
        skipped (already there, no room, a write error). Never raises for a write it cannot make."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this store's entries take (the ones it knows of)."""

    @property
    @abstractmethod
    def num_entries(self) -> int:
        """Entries this store knows of."""

    def stats(self) -> dict:
        """Counters and size, keys prefixed with the tier name."""
        out = {f"{self.tier}_{k}": v for k, v in self.counters.items()}
        out.update({f"{self.tier}_entries": self.num_entries, f"{self.tier}_bytes": self.nbytes})
        return out

    def wait(self) -> None:
        """Return once the writes accepted so far are done (a background writer's; none by default)."""

    def close(self) -> None:
        """Finish the accepted writes and release what the store holds open (nothing by default)."""


PAGE_STORES: dict[str, type] = {}


def register_page_store(name: str):
    def deco(factory):
        PAGE_STORES[name] = factory
        return factory
    return deco


def make_page_store(name: str, identity: StoreIdentity, *, host_bytes: int = 0, directory=None,
                    disk_bytes: int = 0, background: bool = False, **options) -> PageStore:
    """The store registered as ``name``; ValueError if unknown or its options are missing.
    ``background``: the disk tier writes from its own thread; ``options``: every tier's
    (``half_life_s``, ``clock``)."""
    if name not in PAGE_STORES:
        raise ValueError(f"unknown page store {name!r}; choose from {sorted(PAGE_STORES)}")
    return PAGE_STORES[name](identity, host_bytes=host_bytes, directory=directory, disk_bytes=disk_bytes,
                             background=background, **options)


@register_page_store("host")
def _host(identity, *, host_bytes, directory, disk_bytes, background=False, **options):
    from tinyserve_trt.runtime.kvstore.host import HostPageStore

    return HostPageStore(identity, host_bytes, **options)


@register_page_store("disk")
def _disk(identity, *, host_bytes, directory, disk_bytes, background=False, **options):
    from tinyserve_trt.runtime.kvstore.disk import DiskPageStore

    if directory is None:
        raise ValueError("the disk page store needs a directory")
    return DiskPageStore(identity, directory, disk_bytes, background=background, **options)


@register_page_store("host+disk")
def _host_disk(identity, *, host_bytes, directory, disk_bytes, background=False, **options):
    from tinyserve_trt.runtime.kvstore.host import HostPageStore

    lower = _disk(identity, host_bytes=0, directory=directory, disk_bytes=disk_bytes, background=background,
                  **options)
    return HostPageStore(identity, host_bytes, lower=lower, **options)
