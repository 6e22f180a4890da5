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

from dataclasses import dataclass, replace

import numpy as np
import torch

from tinyserve_trt.ops import fine_bounds, schema, two_level
from tinyserve_trt.ops.policies import get_policy

NEG_INF = float("-inf")
GROUP_SELECTS = ("shared", "head", "union")


@dataclass(frozen=True)
class SelectionSpec:
    """How decode steps select pages. ``page_fraction`` (if set) replaces the
    fixed token budget by ``floor(fraction * n_t) * page_size`` at a step whose
    cache has ``n_t`` pages - used for recall at a share of the pages (with
    ``sub_page_size``: the two-level rule at that token budget). As in the op,
    ``sub_page_size == page_size`` selects exactly as single level."""

    policy: str = "query_aware"
    budget: int = 1024
    page_size: int = 16
    sink_pages: int = 1
    recent_pages: int = 1
    group_reduce: str = "max"
    page_fraction: float | None = None
    sub_page_size: int = 0  # > 0: two-level selection, the op's (``select_sub_pages``)
    candidate_share: float = schema.attribute("candidate_share").default  # two-level: share of pages as candidates
    reuse_steps: int = 1  # > 1: a step reuses the selection of the last step whose offset is a multiple (LServe)
    # How a GQA group's query heads share a choice. "shared": the op's rule (one choice per KV head from
    # the group_reduce of its heads' scores); "head": each query head selects alone (the op's rule with
    # a group of one); "union": each head selects alone and the group attends the union. "head" and
    # "union" are candidate rules measured here (benchmarks/selection_probe.py), not in the op yet.
    group_select: str = "shared"

    def __post_init__(self):
        schema.OpAttributes(policy=self.policy, sink_pages=self.sink_pages, recent_pages=self.recent_pages,
                            group_reduce=self.group_reduce, sub_page_size=self.sub_page_size,
                            candidate_share=self.candidate_share)
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.budget < 0:
            raise ValueError(f"budget must be >= 0 (0 = dense), got {self.budget}")
        if self.page_fraction is not None and not 0.0 < self.page_fraction <= 1.0:
            raise ValueError(f"page_fraction must be in (0, 1], got {self.page_fraction}")
        if not isinstance(self.reuse_steps, int) or self.reuse_steps < 1:
            raise ValueError(f"reuse_steps must be an int >= 1, got {self.reuse_steps!r}")
        if self.group_select not in GROUP_SELECTS:
            raise ValueError(f"group_select must be one of {GROUP_SELECTS}, got {self.group_select!r}")
        if self.sub_page_size and (self.sub_page_size < 0 or self.page_size % self.sub_page_size):
            raise ValueError(f"sub_page_size must divide page_size {self.page_size}; got {self.sub_page_size}")

    @property
    def is_dense(self) -> bool:
        return not get_policy(self.policy).selects or (self.page_fraction is None and self.budget == 0)

    def label(self) -> str:
        if not get_policy(self.policy).selects:
            return "dense"
        size = f"{self.page_fraction:.0%}" if self.page_fraction is not None else str(self.budget)
        level = f"[{self.page_size}->{self.sub_page_size}]" if self.sub_page_size else ""
        heads = "" if self.group_select == "shared" else f"/{self.group_select}"
        return f"{self.policy}{level}{heads}@{size}"


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


def page_mass(probs: torch.Tensor, page_size: int, n_pages: int) -> torch.Tensor:
    """Attention mass per page ``[Hkv, G, C, n_pages]`` of probabilities ``[Hkv, G, C, T]`` over keys ``0..T-1``."""
    Hkv, G, C, T = probs.shape
    padded = torch.nn.functional.pad(probs, (0, n_pages * page_size - T))
    return padded.view(Hkv, G, C, n_pages, page_size).sum(-1)


def page_scores(spec: SelectionSpec, q, kmin, kmax, mass=None) -> torch.Tensor:
    """The group's combined page scores ``[Hkv, C, NP]`` under ``spec.policy``; unless
    ``spec.group_select`` is "shared", each query head's own: ``[Hkv * G, C, NP]``.

    q: [Hkv, G, C, D] the chunk's queries; kmin/kmax: [Hkv, NP, D];
    mass: ``page_mass`` of the dense attention (read by a policy that
    ``reads_attention_mass`` only; the token's own probability lands in its own
    page, which is forced or not yet written, so it never changes a choice).
    The per-head score is the registry policy's ``score_torch``.
    """
    policy = get_policy(spec.policy)
    if not policy.selects:
        raise ValueError(f"policy {spec.policy!r} does not select pages")
    per_head = policy.score_torch(q, kmin, kmax, mass)
    if spec.group_select != "shared":
        return per_head.flatten(0, 1)
    return per_head.amax(dim=1) if spec.group_reduce == "max" else per_head.sum(dim=1)


def _top_take(scores: torch.Tensor, candidates: torch.Tensor, take: torch.Tensor) -> torch.Tensor:
    """Mask of the ``take [1|Hkv, C, 1]`` best ``candidates`` by ``scores``; a stable descending
    sort, so ties go to the lower page index, as the reference's stable argsort."""
    scores = scores.masked_fill(~candidates, NEG_INF)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    idx = torch.arange(scores.shape[-1])
    rank = torch.empty_like(order).scatter_(-1, order, idx.expand_as(order))
    return candidates & (rank < take)


def _written_and_forced(spec: SelectionSpec, n_t: torch.Tensor, n_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[C, NP]`` masks: the pages written at each step (``n_t`` of them), and the forced ones
    among them (the first ``sink_pages`` and the last ``recent_pages``)."""
    idx = torch.arange(n_pages)[None, :]
    valid = idx < n_t[:, None]
    return valid, valid & ((idx < spec.sink_pages) | (idx >= (n_t - spec.recent_pages)[:, None]))


def step_budgets(spec: SelectionSpec, positions: torch.Tensor) -> torch.Tensor:
    """Token budget ``[C]`` of the decode steps at ``positions [C]``: the spec's budget, or with a
    ``page_fraction`` ``floor(fraction * n_t)`` pages' worth of tokens (``n_t`` pages in the cache)."""
    ps = spec.page_size
    n_t = (positions + ps - 1) // ps
    if spec.page_fraction is not None:
        return torch.floor(spec.page_fraction * n_t.double()).long() * ps
    return torch.full_like(n_t, spec.budget)


def select_pages(spec: SelectionSpec, positions: torch.Tensor, scores: torch.Tensor,
                 budget: torch.Tensor | None = None) -> torch.Tensor:
    """Kept pages ``[Hkv, C, NP]`` (bool) of decode steps at ``positions [C]``.

    scores: ``page_scores`` ``[Hkv, C, NP]`` (NP >= pages of the last step). A
    dense row (budget 0 or one that covers every page) keeps every written page.
    budget: ``[C]`` tokens per step, overriding the spec's budget / page fraction.
    """
    ps = spec.page_size
    n_t = (positions + ps - 1) // ps  # pages in the cache at each step
    valid, forced = _written_and_forced(spec, n_t, scores.shape[-1])
    if budget is None:
        budget = step_budgets(spec, positions)
    keep_n = torch.maximum(budget // ps, forced.sum(-1))
    dense_row = (budget <= 0) | (keep_n >= n_t)  # [C]
    if spec.is_dense or bool(dense_row.all()):
        return valid.expand(scores.shape[0], -1, -1)
    take = (keep_n - forced.sum(-1))[None, :, None]
    keep = forced | _top_take(scores, valid & ~forced, take)
    return torch.where(dense_row[None, :, None], valid, keep)


def sub_page_bounds(k: torch.Tensor, spec: SelectionSpec, kmin: torch.Tensor, kmax: torch.Tensor):
    """The op's two-level bounds of every sub-page: ``(lo, hi)`` ``[Hkv, NP * r, D]`` from the keys
    ``k [Hkv, T, D]`` and their page bounds ``kmin/kmax [Hkv, NP, D]`` (``page_min_max``): the exact
    sub-page min/max encoded to 4-bit codes and decoded as the op reads ``key_sub_bounds``
    (``ops.fine_bounds``). The partial last page is padded by repeating its last key, which changes
    no bound (and that page is forced, so its sub-page scores are never read)."""
    ps, sp = spec.page_size, spec.sub_page_size
    Hkv, n_pages, D = kmin.shape
    pad = n_pages * ps - k.shape[1]
    k_rep = torch.cat([k, k[:, -1:].expand(Hkv, pad, D)], dim=1) if pad else k
    smin, smax = page_min_max(k_rep, sp)
    shape = (Hkv, n_pages, ps // sp, D)
    codes = fine_bounds.encode(smin.reshape(shape).numpy(), smax.reshape(shape).numpy(), kmin.numpy(),
                               kmax.numpy())
    lo, hi = fine_bounds.decode(codes, kmin.numpy(), kmax.numpy())
    return tuple(torch.from_numpy(x).to(k.dtype).reshape(Hkv, n_pages * (ps // sp), D) for x in (lo, hi))


def select_sub_pages(spec: SelectionSpec, positions: torch.Tensor, coarse: torch.Tensor,
                     fine: torch.Tensor) -> torch.Tensor:
    """Two-level selection: kept sub-pages ``[Hkv, C, NP * r]`` (bool, ``r = page_size / sub_page_size``)
    by the op's rule itself (``ops.two_level.select_sub_pages``), one decode step and KV head at a
    time, at the step's token budget (:func:`step_budgets`). ``coarse [Hkv, C, NP]`` page scores;
    ``fine [Hkv, C, NP * r]`` sub-page scores from the op's 4-bit bounds (:func:`sub_page_bounds`)."""
    ps, sp = spec.page_size, spec.sub_page_size
    r = ps // sp
    coarse64, fine64 = coarse.double().numpy(), fine.double().numpy()
    keep = np.zeros(fine.shape, bool)
    for c, (t, budget) in enumerate(zip(positions.tolist(), step_budgets(spec, positions).tolist())):
        n = -(-t // ps)
        for h in range(coarse.shape[0]):
            keep[h, c, :n * r] = two_level.select_sub_pages(
                coarse64[h, c, :n], fine64[h, c, :n * r], t, budget, ps, sp, spec.candidate_share,
                spec.sink_pages, spec.recent_pages)
    return torch.from_numpy(keep)


def group_keep(spec: SelectionSpec, keep: torch.Tensor, groups: int) -> torch.Tensor:
    """Kept units ``[Hkv, 1|G, C, N]`` from a selection over KV heads ``[Hkv, C, N]`` ("shared") or
    over query heads ``[Hkv * G, C, N]`` ("head": each its own; "union": the group's union)."""
    if spec.group_select == "shared":
        return keep[:, None]
    keep = keep.unflatten(0, (-1, groups))
    return keep.any(dim=1, keepdim=True) if spec.group_select == "union" else keep


def two_level_keep(spec: SelectionSpec, positions: torch.Tensor, q, kmin, kmax, lo, hi, mass=None) -> torch.Tensor:
    """What a two-level decode step attends: kept sub-pages ``[Hkv, C, NP * r]`` plus each step's own
    sub-page (``positions // sub_page_size``: the token itself; its cached neighbours there sit in the
    last page, which is forced). q ``[Hkv, G, C, D]``; kmin/kmax ``[Hkv, NP, D]``; lo/hi
    (:func:`sub_page_bounds`) ``[Hkv, >= NP * r, D]``; mass: ``page_mass``, for a policy that reads it.
    Unless ``spec.group_select`` is "shared", the rows are the query heads' (``[Hkv * G, C, NP * r]``)."""
    sp = spec.sub_page_size
    n_sub = kmin.shape[1] * (spec.page_size // sp)
    coarse = page_scores(spec, q, kmin, kmax, mass)
    fine = page_scores(replace(spec, page_size=sp, sub_page_size=0), q, lo[:, :n_sub], hi[:, :n_sub])
    keep = select_sub_pages(spec, positions, coarse, fine)
    return keep | (torch.arange(n_sub)[None, :] == (positions // sp)[:, None])


def reuse_selection(spec: SelectionSpec, positions: torch.Tensor, q_start: int, keep: torch.Tensor,
                    unit: int) -> torch.Tensor:
    """Rows of ``keep [Hkv, C, N]`` (units of ``unit`` tokens) replaced by their anchor row's (the
    step ``q_start + k*floor((t - q_start)/k)``, k = ``reuse_steps``) plus the row's own forced
    pages (sinks, recent pages): what a decode step that reuses an earlier selection attends.
    Anchors must lie in the same chunk (chunks start at multiples of k from ``q_start``)."""
    k = spec.reuse_steps
    if k <= 1:
        return keep
    off = positions - q_start
    anchor = (off // k) * k - off[0]
    if bool((anchor < 0).any()):
        raise ValueError("reuse anchors outside the chunk")
    ps = spec.page_size
    r = ps // unit
    n_t = (positions + ps - 1) // ps
    _, forced = _written_and_forced(spec, n_t, keep.shape[-1] // r)
    forced = forced.repeat_interleave(r, dim=-1)
    return keep[:, anchor] | forced[None]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, spec: SelectionSpec,
                     scale: float, chunk: int = 256, probe=None, layer: int = 0) -> torch.Tensor:
    """Attention of decode steps at positions ``q_start .. q_start+S-1``.

    q: [H, S, D]; k, v: [Hkv, q_start + S, D] (every key up to the last query,
    after rotary). Returns ``[H, S, D]``. ``probe`` (optional, a
    ``recall.RecallProbe`` with the same page size unless ``spec`` is dense)
    receives each chunk's queries, page metadata, sub-page bounds and dense
    attention probabilities. Does not modify its inputs; memory is
    ``O(H * chunk * T)``.
    """
    H, S, D = q.shape
    Hkv, T, _ = k.shape
    if T != q_start + S:
        raise ValueError(f"keys cover {T} positions, queries end at {q_start + S}")
    ps = probe.page_size if probe is not None and spec.is_dense else spec.page_size
    if probe is not None and probe.page_size != ps:
        raise ValueError(f"probe page size {probe.page_size} differs from the selection's {ps}")
    G = H // Hkv
    kmin, kmax = page_min_max(k, ps) if (probe is not None or not spec.is_dense) else (None, None)
    # keys padded to whole pages: logits view as [.., pages, ps]; causality masks the padding
    pad = -(-T // ps) * ps - T
    k_pad = torch.nn.functional.pad(k, (0, 0, 0, pad))
    v_pad = torch.nn.functional.pad(v, (0, 0, 0, pad))
    if spec.sub_page_size and not spec.is_dense:
        lo, hi = sub_page_bounds(k, spec, kmin, kmax)
    probe_bounds = probe.sub_bounds(k, kmin, kmax) if probe is not None else None
    q_scaled = q * scale  # scaling q scales query_aware scores by a positive constant: same choices
    out = torch.empty_like(q)
    for c0 in range(0, S, chunk):
        c1 = min(S, c0 + chunk)
        C = c1 - c0
        positions = torch.arange(q_start + c0, q_start + c1)
        n_np = -(-(q_start + c1) // ps)
        width = n_np * ps
        qc = q_scaled[:, c0:c1].reshape(Hkv, G, C, D)
        logits = torch.bmm(qc.reshape(Hkv, G * C, D), k_pad[:, :width].transpose(1, 2)).view(Hkv, G, C, width)
        logits.masked_fill_(torch.arange(width)[None, :] > positions[:, None], NEG_INF)
        dense_probs = mass = None
        needs_mass = get_policy(spec.policy).reads_attention_mass or probe is not None
        if spec.is_dense or needs_mass:
            dense_probs = torch.softmax(logits, dim=-1)
            if needs_mass:
                mass = dense_probs.view(Hkv, G, C, n_np, ps).sum(-1)
        if probe is not None:
            probe.observe(layer, positions, qc, kmin[:, :n_np], kmax[:, :n_np], dense_probs, probe_bounds)
        if spec.is_dense:
            probs = dense_probs
        elif spec.sub_page_size:
            sp = spec.sub_page_size
            keep = two_level_keep(spec, positions, qc, kmin[:, :n_np], kmax[:, :n_np], lo, hi, mass)
            keep = reuse_selection(spec, positions, q_start, keep, sp)
            keep = group_keep(spec, keep | (torch.arange(keep.shape[-1])[None, :] == (positions // sp)[:, None]), G)
            logits.view(Hkv, G, C, n_np * (ps // sp), sp).masked_fill_(~keep[..., None], NEG_INF)
            probs = torch.softmax(logits, dim=-1)
        else:
            keep = select_pages(spec, positions, page_scores(spec, qc, kmin[:, :n_np], kmax[:, :n_np], mass))
            keep = reuse_selection(spec, positions, q_start, keep, ps)
            keep = keep | (torch.arange(n_np)[None, :] == (positions // ps)[:, None])  # own page: the token itself
            logits.view(Hkv, G, C, n_np, ps).masked_fill_(~group_keep(spec, keep, G)[..., None], NEG_INF)
            probs = torch.softmax(logits, dim=-1)
        out[:, c0:c1] = torch.bmm(probs.view(Hkv, G * C, width), v_pad[:, :width]).view(H, C, D)
    return out
