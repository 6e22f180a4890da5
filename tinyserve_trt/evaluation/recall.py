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

from .decode_attention import SelectionSpec, select_pages


def step_recall(spec: SelectionSpec, positions, q, kmin, kmax, dense_probs) -> torch.Tensor:
    """Recall ``[Hkv, G, C]`` of ``spec`` at decode steps ``positions [C]``.

    dense_probs: ``[Hkv, G, C, T]`` causal softmax over keys ``0..t`` per row;
    q, kmin, kmax as in ``select_pages`` (kmin/kmax cover ``ceil(T / ps)`` pages).
    """
    ps = spec.page_size
    n_pages = kmin.shape[1]
    Hkv, G, C, T = dense_probs.shape
    padded = torch.nn.functional.pad(dense_probs, (0, n_pages * ps - T))
    page_mass = padded.view(Hkv, G, C, n_pages, ps).sum(-1)  # causal: page t // ps holds the token itself
    keep = select_pages(spec, positions, q, kmin, kmax, dense_probs)  # [Hkv, C, NP]
    own_page = torch.arange(n_pages)[None, :] == (positions // ps)[:, None]  # the token is always attended
    keep = keep | own_page
    return (page_mass * keep[:, None]).sum(-1)


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

    def observe(self, layer: int, positions, q, kmin, kmax, dense_probs) -> None:
        for spec in self.specs:
            r = step_recall(spec, positions, q, kmin, kmax, dense_probs)
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
