"""Decode-mode sparse attention for every query position at once (torch).

Row ``t`` of the result is what one decode step of QueryAwareSparseAttention
(``docs/op.md``) returns at ``past_len = t``: the cache holds tokens ``< t``
in pages of ``page_size``; the step scores the pages, keeps the forced pages
(first ``sink_pages``, last ``recent_pages``) plus the best others up to
``max(budget // ps, #forced)`` pages, and attends those tokens plus token
``t`` itself. Evaluating all positions in one pass is what makes perplexity
over 8K tokens affordable on a CPU; ``tests/evaluation`` checks each row
against the numpy reference run as a real decode step.

Why page metadata can be computed once: for query ``t``, a page is either
full (all its ``ps`` keys are ``< t``, so its min/max is the same for every
later ``t``), the partial last page (always forced in, so its score never
matters), or not yet written (never kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import schema

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SelectionSpec:
    """How decode steps select pages. ``page_fraction`` (if set) replaces the
    fixed token budget by ``floor(fraction * n_t) * page_size`` at a step whose
    cache has ``n_t`` pages - used for recall at a share of the pages."""

    policy: str = "query_aware"
    budget: int = 1024
    page_size: int = 16
    sink_pages: int = 1
    recent_pages: int = 1
    group_reduce: str = "max"
    page_fraction: float | None = None

    def __post_init__(self):
        schema.OpAttributes(policy=self.policy, sink_pages=self.sink_pages, recent_pages=self.recent_pages,
                            group_reduce=self.group_reduce)
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.budget < 0:
            raise ValueError(f"budget must be >= 0 (0 = dense), got {self.budget}")
        if self.page_fraction is not None and not 0.0 < self.page_fraction <= 1.0:
            raise ValueError(f"page_fraction must be in (0, 1], got {self.page_fraction}")

    @property
    def is_dense(self) -> bool:
        return self.policy == "dense" or (self.page_fraction is None and self.budget == 0)

    def label(self) -> str:
        if self.policy == "dense":
            return "dense"
        size = f"{self.page_fraction:.0%}" if self.page_fraction is not None else str(self.budget)
        return f"{self.policy}@{size}"


DENSE = SelectionSpec(policy="dense", budget=0)


def page_min_max(key: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page elementwise min/max of ``key [Hkv, T, D]`` -> two ``[Hkv, ceil(T/ps), D]``.

    The last page, if partial, covers only its ``T % ps`` keys."""
    Hkv, T, D = key.shape
    n = -(-T // page_size)
    pad = n * page_size - T
    if pad:
        key_lo = torch.cat([key, key[:, -1:].expand(Hkv, pad, D)], dim=1)  # repeating a key changes no min/max
    else:
        key_lo = key
    pages = key_lo.view(Hkv, n, page_size, D)
    return pages.amin(dim=2), pages.amax(dim=2)


def _page_scores(spec, q, kmin, kmax, probs, n_pages):
    """Per-head scores ``[Hkv, G, C, NP]`` for the chunk's queries ``q [Hkv, G, C, D]``."""
    if spec.policy == "query_aware":
        return q.clamp(min=0) @ kmax[:, None].transpose(-1, -2) + q.clamp(max=0) @ kmin[:, None].transpose(-1, -2)
    if spec.policy == "window":
        return torch.arange(n_pages, dtype=q.dtype).expand(*q.shape[:3], n_pages)
    if spec.policy == "oracle":
        Hkv, G, C, T = probs.shape
        padded = torch.nn.functional.pad(probs, (0, n_pages * spec.page_size - T))
        return padded.view(Hkv, G, C, n_pages, spec.page_size).sum(-1)
    raise ValueError(f"policy {spec.policy!r} does not select pages")


def select_pages(spec: SelectionSpec, positions: torch.Tensor, q, kmin, kmax, probs) -> torch.Tensor:
    """Kept pages ``[Hkv, C, NP]`` (bool) of decode steps at ``positions [C]``.

    q: [Hkv, G, C, D]; kmin/kmax: [Hkv, NP, D] (NP >= pages of the last step);
    probs: dense attention ``[Hkv, G, C, T]`` (read by ``oracle`` only). A
    dense row (budget 0 or one that covers every page) keeps every written page.
    """
    ps = spec.page_size
    n_pages = kmin.shape[1]
    n_t = (positions + ps - 1) // ps  # pages in the cache at each step
    idx = torch.arange(n_pages)
    valid = idx[None, :] < n_t[:, None]  # [C, NP]
    forced = valid & ((idx[None, :] < spec.sink_pages) | (idx[None, :] >= (n_t - spec.recent_pages)[:, None]))
    if spec.page_fraction is not None:
        budget = torch.floor(spec.page_fraction * n_t.double()).long() * ps
    else:
        budget = torch.full_like(n_t, spec.budget)
    keep_n = torch.maximum(budget // ps, forced.sum(-1))
    dense_row = (budget <= 0) | (keep_n >= n_t)  # [C]
    if spec.is_dense or bool(dense_row.all()):
        return valid.expand(kmin.shape[0], -1, -1)
    per_head = _page_scores(spec, q, kmin, kmax, probs, n_pages)
    scores = per_head.amax(dim=1) if spec.group_reduce == "max" else per_head.sum(dim=1)  # [Hkv, C, NP]
    candidates = valid & ~forced
    scores = scores.masked_fill(~candidates, NEG_INF)
    # stable descending sort: ties go to the lower page index, as the reference's stable argsort
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, idx.expand_as(order))
    take = (keep_n - forced.sum(-1))[None, :, None]
    keep = forced | (candidates & (rank < take))
    return torch.where(dense_row[None, :, None], valid, keep)


def token_mask(keep_pages: torch.Tensor, positions: torch.Tensor, page_size: int, num_keys: int) -> torch.Tensor:
    """``[Hkv, C, num_keys]`` bool: the cached tokens of kept pages (``< t``) plus token ``t`` itself."""
    j = torch.arange(num_keys)
    page_of = (j // page_size).clamp(max=keep_pages.shape[-1] - 1)
    cached = keep_pages[:, :, page_of] & (j[None, :] < positions[:, None])
    return cached | (j[None, :] == positions[:, None])


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, spec: SelectionSpec,
                     scale: float, chunk: int = 256, probe=None, layer: int = 0) -> torch.Tensor:
    """Attention of decode steps at positions ``q_start .. q_start+S-1``.

    q: [H, S, D]; k, v: [Hkv, q_start + S, D] (every key up to the last query,
    after rotary). Returns ``[H, S, D]``. ``probe`` (optional) receives, per
    chunk, the dense probabilities and the inputs it needs to measure what
    other selections would keep (see ``recall.RecallProbe``). Does not modify
    its inputs; memory is ``O(H * chunk * T)``.
    """
    H, S, D = q.shape
    Hkv, T, _ = k.shape
    if T != q_start + S:
        raise ValueError(f"keys cover {T} positions, queries end at {q_start + S}")
    G = H // Hkv
    kmin = kmax = None
    if not spec.is_dense or probe is not None:
        kmin, kmax = page_min_max(k, spec.page_size)
    out = torch.empty_like(q)
    for c0 in range(0, S, chunk):
        c1 = min(S, c0 + chunk)
        t_hi = q_start + c1  # keys this chunk can see
        positions = torch.arange(q_start + c0, t_hi)
        qc = q[:, c0:c1].view(Hkv, G, c1 - c0, D)
        logits = (qc @ k[:, None, :t_hi].transpose(-1, -2)) * scale  # [Hkv, G, C, t_hi]
        causal = torch.arange(t_hi)[None, :] <= positions[:, None]
        logits = logits.masked_fill(~causal, NEG_INF)
        dense_probs = torch.softmax(logits, dim=-1)
        n_np = -(-t_hi // spec.page_size)
        if probe is not None:
            probe.observe(layer, positions, qc, kmin[:, :n_np], kmax[:, :n_np], dense_probs)
        if spec.is_dense:
            probs = dense_probs
        else:
            keep = select_pages(spec, positions, qc, kmin[:, :n_np], kmax[:, :n_np], dense_probs)
            mask = token_mask(keep, positions, spec.page_size, t_hi)  # [Hkv, C, t_hi]
            probs = torch.softmax(logits.masked_fill(~mask[:, None], NEG_INF), dim=-1)
        out[:, c0:c1] = (probs @ v[:, None, :t_hi]).reshape(H, c1 - c0, D)
    return out

