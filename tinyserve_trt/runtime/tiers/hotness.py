"""HotnessPolicy: which pages of a TieredPagePool stay hot, from the op's page selections.

Every decode step the op reports ``selected_pages [B, Hkv, NP]`` per layer:
which logical pages of each sequence it attended. :meth:`HotnessPolicy.observe`
maps them to page handles through the batch's page table and adds them to
per-page hit counts that decay geometrically (``decay`` per step), so a page
shared by many sequences (a common prefix) counts the hits of all of them.

:meth:`HotnessPolicy.plan` picks the pages to demote: never a sink (the first
``sink_pages`` logical pages of any holder) or a recent page (the last
``recent_pages`` of any holder - the page being written is one), never a
partial page; among the rest, the least hit go cold until the hot count
meets the target (``hot_fraction`` of live pages and/or ``max_hot_pages``).
Protected pages stay hot even when that exceeds the target. The policy only
decides; :meth:`rebalance` asks the pool to demote.

:meth:`plan_promotions`: when the hot count is below the target (sequences
ended, pages were freed), the most hit cold pages whose decayed hits reach
``promote_hits`` return to the hot tier (exact reads again for the pages the
op keeps selecting), at most ``max_promotions`` per step and only into room
under the target - never past it, so a promotion is not undone by the next
demotion, and the allocation headroom ``Tiering`` sized stays free.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from tinyserve_trt.contracts.cold_tier import HotnessConfig
from tinyserve_trt.runtime.pages import OutOfPagesError
from tinyserve_trt.runtime.tiers.pool import TieredPagePool


class HotnessPolicy:
    """Decayed per-page hit counts and the demotion plan; see the module docstring."""

    def __init__(self, config: HotnessConfig, num_pages: int):
        self.config = config
        self.hits = np.zeros(num_pages, np.float64)  # by page handle

    def observe(self, selected_pages: np.ndarray, page_table: np.ndarray, num_pages: np.ndarray) -> None:
        """Decay, then count one step's selections. Call once per step, all layers together.

        selected_pages: ``[..., B, Hkv, NP]`` bool (e.g. ``[layers, B, Hkv, NP]``), the op's output.
        page_table:     ``[B, NP]`` page handles (the batch's, before ``physical_table``).
        num_pages:      ``[B]`` logical pages in use per row (``ceil(past_lens / ps)``); later
                        columns are padding and are not counted.
        """
        sel = np.asarray(selected_pages, bool)
        page_table = np.asarray(page_table, np.int64)
        B, NP = page_table.shape
        if sel.ndim < 3 or sel.shape[-3] != B or sel.shape[-1] != NP:
            raise ValueError(f"selected_pages {sel.shape} does not match page_table {page_table.shape}")
        counts = sel.reshape(-1, B, sel.shape[-2], NP).sum(axis=(0, 2))  # [B, NP]
        in_use = np.arange(NP)[None, :] < np.asarray(num_pages, np.int64)[:, None]
        self.hits *= self.config.decay
        np.add.at(self.hits, page_table[in_use], counts[in_use])

    def protected(self, holders: Iterable[Sequence[int]]) -> set[int]:
        """Sinks and recent pages of every holder's page list (logical order)."""
        s, r = self.config.sink_pages, self.config.recent_pages
        out: set[int] = set()
        for pages in holders:
            pages = list(pages)
            out.update(pages[:s])
            out.update(pages[-r:])
        return out

    def target_hot(self, num_live: int) -> int:
        """Hot pages the budget allows among ``num_live`` live pages."""
        cfg = self.config
        target = num_live
        if cfg.hot_fraction is not None:
            target = min(target, math.ceil(cfg.hot_fraction * num_live))
        if cfg.max_hot_pages is not None:
            target = min(target, cfg.max_hot_pages)
        return target

    def plan(self, pool: TieredPagePool, holders: Iterable[Sequence[int]]) -> list[int]:
        """Handles to demote, least hit first. Does not modify the pool.

        ``holders``: every live sequence's page list (``seq.pages``), in logical order.
        """
        hot, cold = pool.hot_pages(), pool.cold_pages()
        dead = np.ones(self.hits.shape, bool)
        dead[hot + cold] = False
        self.hits[dead] = 0.0  # a freed handle's history must not follow it to its next page
        excess = len(hot) - self.target_hot(len(hot) + len(cold))
        if excess <= 0:
            return []
        keep = self.protected(holders)
        cands = [p for p in hot if p not in keep and pool.is_full(p)]
        cands.sort(key=lambda p: (self.hits[p], p))
        return cands[:excess]

    def plan_promotions(self, pool: TieredPagePool) -> list[int]:
        """Cold handles to promote, most hit first: room under the target, free hot slots and
        ``max_promotions`` bound the count. Does not modify the pool."""
        hot, cold = pool.hot_pages(), pool.cold_pages()
        room = min(self.target_hot(len(hot) + len(cold)) - len(hot), pool.num_hot_free, self.config.max_promotions)
        if room <= 0 or not cold:
            return []
        cands = [p for p in cold if self.hits[p] >= self.config.promote_hits]
        cands.sort(key=lambda p: (-self.hits[p], p))
        return cands[:room]

    def promote(self, pool: TieredPagePool) -> list[int]:
        """Promote :meth:`plan_promotions`' pages; returns them."""
        done = self.plan_promotions(pool)
        for page in done:
            pool.promote(page)
        return done

    def rebalance(self, pool: TieredPagePool, holders: Iterable[Sequence[int]]) -> list[int]:
        """Demote :meth:`plan`'s pages (stopping when the cold tier is full); returns those demoted."""
        done = []
        for page in self.plan(pool, list(holders)):
            try:
                pool.demote(page)
            except OutOfPagesError:
                break
            done.append(page)
        return done
