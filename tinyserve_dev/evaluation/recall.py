"""Attention-mass recall: how much of the dense attention a selection keeps.

For one decode step, one layer and one query head, recall is the share of
that head's dense softmax mass (over the cached tokens and the token itself)
that falls on the tokens the step attends. Single level: the kept pages plus
the token. Two-level (``spec.sub_page_size > 0``, the op's default): the
sub-pages the op's rule keeps (``decode_attention.two_level_keep``) at the
step's token budget plus the token, the mass summed per sub-page. With a
``page_fraction`` both get ``floor(fraction * n_t)`` pages' worth of tokens.
``RecallProbe`` measures it for several selections on the same dense pass
(``decode_attention(..., probe=)``), so ten selections cost one forward.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch

from .decode_attention import (SelectionSpec, group_keep, page_scores, select_pages, sub_page_bounds,
                               two_level_keep)


def unit_mass(probs: torch.Tensor, unit: int) -> torch.Tensor:
    """Mass per block of ``unit`` keys ``[Hkv, G, C, W / unit]`` of probabilities ``[Hkv, G, C, W]``
    (``W`` a multiple of ``unit``)."""
    Hkv, G, C, W = probs.shape
    return probs.view(Hkv, G, C, W // unit, unit).sum(-1)


def kept_mass(keep: torch.Tensor, positions: torch.Tensor, unit: int, mass: torch.Tensor) -> torch.Tensor:
    """``[Hkv, G, C]`` mass on the kept blocks ``keep [Hkv, 1|G, C, N]`` (``group_keep``) plus each
    step's own block (``positions // unit``: the token's own share, always attended); mass
    ``[Hkv, G, C, N]``."""
    own = torch.arange(mass.shape[-1])[None, :] == (positions // unit)[:, None]
    return (mass * (keep | own)).sum(-1)


def step_recall(spec: SelectionSpec, positions, scores, mass) -> torch.Tensor:
    """Single-level recall ``[Hkv, G, C]`` of ``spec`` at decode steps ``positions [C]``.

    scores: ``page_scores`` of the policy ``[Hkv, C, NP]``; mass: ``page_mass``
    of the dense causal attention ``[Hkv, G, C, NP]`` (keys ``0..t`` per row, so
    page ``t // ps`` holds the token's own share, which is always attended).
    """
    return kept_mass(group_keep(spec, select_pages(spec, positions, scores), mass.shape[1]), positions,
                     spec.page_size, mass)


def step_recall_two_level(spec: SelectionSpec, positions, q, kmin, kmax, lo, hi, probs) -> torch.Tensor:
    """Two-level recall ``[Hkv, G, C]``: the dense mass on what the op attends (its kept sub-pages).

    q ``[Hkv, G, C, D]``; kmin/kmax ``[Hkv, NP, D]``; lo/hi: ``sub_page_bounds`` ``[Hkv, >= NP * r, D]``;
    probs: the dense causal attention ``[Hkv, G, C, NP * ps]`` (keys ``0..t`` per row).
    """
    mass = unit_mass(probs, spec.page_size)
    keep = group_keep(spec, two_level_keep(spec, positions, q, kmin, kmax, lo, hi, mass), q.shape[1])
    return kept_mass(keep, positions, spec.sub_page_size, unit_mass(probs, spec.sub_page_size))


class RecallProbe:
    """Accumulates mean recall per (selection label, layer) over heads and steps."""

    def __init__(self, specs: Sequence[SelectionSpec]):
        sizes = {s.page_size for s in specs}
        if len(sizes) > 1:
            raise ValueError(f"probe selections must share one page size, got {sorted(sizes)}")
        labels = [s.label() for s in specs]
        if len(set(labels)) < len(labels):
            raise ValueError(f"probe selections must have distinct labels, got {labels}")
        self.specs = tuple(specs)
        self._sum: dict[tuple[str, int], float] = defaultdict(float)
        self._count: dict[tuple[str, int], int] = defaultdict(int)

    @property
    def page_size(self) -> int:
        return self.specs[0].page_size

    def sub_bounds(self, k, kmin, kmax) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The op's sub-page bounds per two-level sub-page size of the probe's selections, from the
        layer's keys ``k [Hkv, T, D]`` and page bounds ``kmin/kmax [Hkv, ceil(T / ps), D]``."""
        bounds = {}
        for s in self.specs:
            if s.sub_page_size and s.sub_page_size not in bounds:
                bounds[s.sub_page_size] = sub_page_bounds(k, s, kmin, kmax)
        return bounds

    def observe(self, layer: int, positions, q, kmin, kmax, probs, sub_bounds=None) -> None:
        """One chunk of decode steps: q [Hkv, G, C, D], kmin/kmax [Hkv, NP, D], dense probabilities
        probs [Hkv, G, C, NP * ps], sub_bounds: ``sub_bounds`` of the layer (two-level selections)."""
        mass = unit_mass(probs, self.page_size)
        scores = {}  # one scoring per (policy, group_reduce), shared by the page fractions
        for spec in self.specs:
            if spec.sub_page_size:
                lo, hi = sub_bounds[spec.sub_page_size]
                r = step_recall_two_level(spec, positions, q, kmin, kmax, lo, hi, probs)
            else:
                key = (spec.policy, spec.group_reduce)
                if key not in scores:
                    scores[key] = page_scores(spec, q, kmin, kmax, mass)
                r = step_recall(spec, positions, scores[key], mass)
            key = (spec.label(), layer)
            self._sum[key] += float(r.double().sum())
            self._count[key] += r.numel()

    def layers(self) -> list[int]:
        return sorted({layer for _, layer in self._count})

    def per_layer(self, label: str) -> dict[int, float]:
        return {layer: self._sum[(label, layer)] / self._count[(label, layer)]
                for (lab, layer) in sorted(self._count, key=lambda k: k[1]) if lab == label}

    def mean(self, label: str, dense_layers: int = 0) -> float:
        """Mean over layers; the first ``dense_layers`` count as recall 1 (they run dense)."""
        per = self.per_layer(label)
        if not per:
            raise KeyError(f"no recall recorded for {label!r}")
        return sum(1.0 if layer < dense_layers else r for layer, r in per.items()) / len(per)
