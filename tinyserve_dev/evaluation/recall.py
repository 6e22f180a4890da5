"""Attention-mass recall: how much of the dense attention a page selection keeps.

For one decode step, one layer and one query head, recall is the share of
that head's dense softmax mass (over the cached tokens and the token itself)
that falls on the tokens the step attends: the kept pages plus the token.
``RecallProbe`` measures it for several selections on the same dense pass
(``decode_attention(..., probe=)``), so ten selections cost one forward.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch

from .decode_attention import SelectionSpec, page_scores, select_pages


def step_recall(spec: SelectionSpec, positions, scores, mass) -> torch.Tensor:
    """Recall ``[Hkv, G, C]`` of ``spec`` at decode steps ``positions [C]``.

    scores: ``page_scores`` of the policy ``[Hkv, C, NP]``; mass: ``page_mass``
    of the dense causal attention ``[Hkv, G, C, NP]`` (keys ``0..t`` per row, so
    page ``t // ps`` holds the token's own share, which is always attended).
    """
    keep = select_pages(spec, positions, scores)
    own_page = torch.arange(mass.shape[-1])[None, :] == (positions // spec.page_size)[:, None]
    return (mass * (keep | own_page)[:, None]).sum(-1)


class RecallProbe:
    """Accumulates mean recall per (selection label, layer) over heads and steps."""

    def __init__(self, specs: Sequence[SelectionSpec]):
        sizes = {s.page_size for s in specs}
        if len(sizes) > 1:
            raise ValueError(f"probe selections must share one page size, got {sorted(sizes)}")
        self.specs = tuple(specs)
        self._sum: dict[tuple[str, int], float] = defaultdict(float)
        self._count: dict[tuple[str, int], int] = defaultdict(int)

    @property
    def page_size(self) -> int:
        return self.specs[0].page_size

    def observe(self, layer: int, positions, q, kmin, kmax, mass) -> None:
        """One chunk of decode steps: q [Hkv, G, C, D], kmin/kmax [Hkv, NP, D], mass [Hkv, G, C, NP]."""
        scores = {}  # one scoring per (policy, group_reduce), shared by the page fractions
        for spec in self.specs:
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
