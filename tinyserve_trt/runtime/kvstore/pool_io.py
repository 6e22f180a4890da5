"""Pages between a PagePool and a PageStore: a pool page as a PageBlock, and back.

Functions of a pool (duck-typed, as ``pool_integrity``: the store package does not import
``pages``). A page leaves the pool only whole (full in every layer) and comes back into a freshly
allocated hot page the caller holds alone, inside ``allocate(fill=...)``. A tiered pool's cold
page leaves dequantized, as a promotion would make it hot (``KVStorage.read_block``); such an
engine's store identity names its cold format, so an all-hot engine never reads those pages.
"""

from __future__ import annotations

import numpy as np

from tinyserve_trt.runtime.kvstore.block import PageBlock


def exportable(pool, page: int) -> bool:
    """Whether ``page`` is bound to a slot and full in every layer."""
    phys = int(pool._physical_ids(np.array([page]))[0])
    return phys >= 0 and bool(np.all(pool._num_valid[:, phys] == pool.page_size))


def page_block(pool, page: int, tokens, parent: bytes | None) -> PageBlock | None:
    """``page``'s content as a PageBlock (copies), or None when it cannot leave whole
    (partial, or a storage that cannot export)."""
    if not exportable(pool, page):
        return None
    phys = int(pool._physical_ids(np.array([page]))[0])
    try:
        arrays = pool.storage.read_block(phys)
    except NotImplementedError:
        return None
    return PageBlock(tokens=np.asarray(tokens, np.int64), parent=parent,
                     num_valid=pool._num_valid[:, phys].astype(np.int32), **arrays)


def restore_page(pool, page: int, block: PageBlock) -> None:
    """Write ``block`` into ``page`` (writable: just allocated) and set its valid counts; the
    storage writes first, so one that raises leaves the counts as they were."""
    if not pool.is_writable(page):
        raise ValueError(f"page {page} is shared or cached; restore into a fresh page")
    phys = int(pool._physical_ids(np.array([page]))[0])
    if phys >= getattr(pool.storage, "num_hot", pool.num_pages):
        raise ValueError(f"page {page} is cold; restore into a hot page")
    pool.storage.write_block(phys, block)
    pool._num_valid[:, phys] = block.num_valid
