"""KV pages beyond the pool (issue #33): a store of whole pages below the prefix cache.

identity  StoreIdentity: which package (and pool format) an entry belongs to
block     PageBlock: one page, every layer, as one contiguous entry (header + checksum)
reuse     ReuseIndex: hit counts with recency decay, the eviction order of a tier
base      PageStore ABC + PAGE_STORES registry + make_page_store
host      HostPageStore: entries in memory, demoted to a lower store past its budget
disk      DiskPageStore: one file per entry, atomic publish, verified reads, shareable
prefetch  Prefetcher: a queued request's stored pages read on a background thread before admission

The prefix cache (``runtime/prefix_cache.py``) writes pages the pool evicts here and
continues a match from here once the pool's pages run out.
"""

from tinyserve_trt.runtime.kvstore.base import PAGE_STORES, PageStore, make_page_store
from tinyserve_trt.runtime.kvstore.block import PageBlock
from tinyserve_trt.runtime.kvstore.identity import StoreIdentity

__all__ = ["PAGE_STORES", "PageBlock", "PageStore", "StoreIdentity", "make_page_store"]
