"""Storage fault injection for the page-pool transaction tests (issue #29).

``FlakyStorage`` wraps a pool's KVStorage and raises ``InjectedFault`` on the calls a
test arms - before the data move, or after it (the worst case: the storage changed
data, then raised). ``pool_state`` is everything a failed pool operation must leave
as it was.
"""

from __future__ import annotations

import numpy as np

FAULTY = ("reset_pages", "copy_page", "demote_page")


class InjectedFault(RuntimeError):
    """What an armed FlakyStorage call raises."""


class FlakyStorage:
    """Delegates to ``inner``; :meth:`arm` makes the next call of one data move raise."""

    def __init__(self, inner):
        self.inner = inner
        self.armed: dict[str, str] = {}  # method -> "before" | "after"
        self.raised: list[str] = []

    def arm(self, method: str, when: str = "before") -> None:
        if method not in FAULTY or when not in ("before", "after"):
            raise ValueError(f"cannot arm {method!r} {when!r}")
        self.armed[method] = when

    def disarm(self) -> None:
        self.armed.clear()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _call(self, name: str, *args):
        when = self.armed.pop(name, None)
        if when == "before":
            self.raised.append(name)
            raise InjectedFault(f"injected {name} failure")
        out = getattr(self.inner, name)(*args)
        if when == "after":
            self.raised.append(name)
            raise InjectedFault(f"injected {name} failure after the move")
        return out

    def reset_pages(self, pages):
        return self._call("reset_pages", pages)

    def copy_page(self, src, dst):
        return self._call("copy_page", src, dst)

    def demote_page(self, hot, cold):
        return self._call("demote_page", hot, cold)


def flaky(pool) -> FlakyStorage:
    """Put a FlakyStorage around ``pool``'s storage (same geometry, so no attach checks)."""
    pool.storage = FlakyStorage(pool.storage)
    return pool.storage


def pool_state(pool) -> dict:
    """Free lists (in order), LRU (in order), refcounts, cached flags, valid counts, handle
    bindings of a tiered pool, and the keys and min/max of every live page as the op reads them."""
    state = dict(free=list(pool._free), evictable=list(pool._evictable), refcount=pool._refcount.tolist(),
                 cached=pool._cached.tolist())
    if hasattr(pool, "_phys"):
        state.update(phys=pool._phys.tolist(), free_hot=list(pool._free_hot), free_cold=list(pool._free_cold))
    live = np.flatnonzero((pool._refcount > 0) | pool._cached)
    store = pool.storage
    # a free page's valid counts and data are not state: allocate resets them
    state["data"] = {int(page): (pool._num_valid[:, p].tolist(),
                                 [tuple(np.array(a).tolist() for a in store.read_page(layer, int(p)))
                                  for layer in range(pool.num_layers)])
                     for page, p in zip(live, pool._physical_ids(live))}
    return state


def check_unchanged(before: dict, after: dict, evicted) -> None:
    """``after`` (a :func:`pool_state`) is ``before``, except that the cached pages in ``evicted``
    (the evict callback's calls during a failed operation) left the LRU for the free lists."""
    if not evicted:
        assert after == before
        return
    ev = set(evicted)
    assert ev <= set(before["evictable"])
    assert after["refcount"] == before["refcount"]
    assert after["cached"] == [c and p not in ev for p, c in enumerate(before["cached"])]
    assert after["evictable"] == [p for p in before["evictable"] if p not in ev]
    assert sorted(after["free"]) == sorted(before["free"] + list(ev))
    assert after["data"] == {p: d for p, d in before["data"].items() if p not in ev}
    if "phys" in before:
        assert after["phys"] == [-1 if p in ev else x for p, x in enumerate(before["phys"])]
        assert sorted(after["free_hot"] + after["free_cold"]) == sorted(
            before["free_hot"] + before["free_cold"] + [before["phys"][p] for p in ev])
