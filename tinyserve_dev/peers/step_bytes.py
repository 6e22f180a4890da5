"""Bytes one decode step reads: the weights it streams plus the KV it attends, from the package.

Weights: every initializer of the package's graph (``model.onnx``; no data is read), except that
a table used only as the data of Gather nodes (the token embedding) costs one row per sequence.
KV, per sequence at ``context`` cached tokens (``row`` = ``num_kv_heads * head_dim`` elements of
``kv_dtype``):
  dense layer (the leading ``dense_layers``; every layer at budget 0 or while the row decodes
  dense by the runtime's rule - ``context + 1 < sparse_min_ratio * budget`` - or when the budget
  covers the context): K and V of every cached token, ``2 * context * row``.
  sparse layer: the key min/max of every page (``2 * pages * row``), for two-level selection
  (``sub_page_size`` > 0) the uint8 sub-page codes of the candidate pages
  (``ops.two_level.candidate_pages``; forced pages are kept unscored), then K and V of the kept
  tokens (``max(budget, forced tokens)``, at most ``context``), ``ops.policies.select_pages`` /
  ``ops.two_level.select_sub_pages``'s counts.
Not counted: activations, the query, the new token's own K/V, scratch. A cold tier's pages are
counted at the hot dtype (an upper bound there). Peers get the same formula with their own KV
dtype and budget 0 (they attend every token): llama.cpp's default KV cache is float16.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinyserve_trt.contracts.dense_layers import dense_layer_indices
from tinyserve_trt.runtime.config import KV_DTYPES


@dataclass(frozen=True)
class StepGeometry:
    """What the KV bytes of a step depend on (a package's manifest fields)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "float32"
    dense_layers: int = 0
    sub_page_size: int = 0
    candidate_share: float = 0.5
    sink_pages: int = 1
    recent_pages: int = 1

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(KV_DTYPES)}, got {self.dtype!r}")
        if self.sub_page_size and self.page_size % self.sub_page_size:
            raise ValueError(f"sub_page_size {self.sub_page_size} must divide page_size {self.page_size}")

    @classmethod
    def of_package(cls, package) -> StepGeometry:
        s = package.spec
        share = s.candidate_share if s.candidate_share is not None else cls.candidate_share
        return cls(s.num_layers, s.num_kv_heads, s.head_dim, s.page_size, s.dtype,
                   len(dense_layer_indices(s.dense_layers, s.num_layers)),
                   s.sub_page_size, share, s.sink_pages, s.recent_pages)


def weight_bytes(model_path: str | Path, batch: int) -> int:
    """Weight bytes a step of ``batch`` sequences streams from the graph at ``model_path``."""
    import onnx

    from tinyserve_trt.export.weights import tensor_bytes

    graph = onnx.load(str(model_path), load_external_data=False).graph
    inits = {t.name: t for t in graph.initializer}
    uses = defaultdict(set)
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in inits:
                uses[name].add((node.op_type, i))
    total = 0
    for name, t in inits.items():
        size = tensor_bytes(t)
        if uses[name] == {("Gather", 0)} and len(t.dims) == 2 and t.dims[0] > 0:
            size = min(size, batch * (size // t.dims[0]))  # an embedding table: one row per sequence
        total += size
    return total


def _kept_tokens(g: StepGeometry, context: int, budget: int) -> tuple[int, int]:
    """(sub-page code bytes per KV head, kept tokens) of one sparse layer and sequence."""
    from tinyserve_trt.ops.two_level import candidate_pages

    ps, pages = g.page_size, -(-context // g.page_size)
    forced_pages = min(pages, g.sink_pages + g.recent_pages)
    if not g.sub_page_size:
        return 0, min(context, max(budget // ps, forced_pages) * ps)
    sp = g.sub_page_size
    cand_tokens = max(candidate_pages(pages, budget, ps, g.candidate_share) * ps, budget)
    candidates = min(pages, max(cand_tokens // ps, forced_pages)) - forced_pages
    codes = candidates * (ps // sp) * g.head_dim  # uint8, one per sub-page and dim
    return codes, min(context, max(budget // sp, forced_pages * (ps // sp)) * sp)


def sparse_applies(context: int, budget: int, sparse_min_ratio: float) -> bool:
    """Whether a decode row at ``context`` cached tokens selects (the runtime's rule, batch.py)."""
    return 0 < budget < context and context + 1 >= sparse_min_ratio * budget


def kv_bytes(g: StepGeometry, context: int, batch: int, budget: int = 0, sparse_min_ratio: float = 0.0,
             kv_dtype: str | None = None) -> int:
    """KV bytes one decode step of ``batch`` sequences at ``context`` cached tokens reads."""
    es = np.dtype(kv_dtype or g.dtype).itemsize
    row = g.num_kv_heads * g.head_dim * es
    dense_layer = 2 * context * row
    if not sparse_applies(context, budget, sparse_min_ratio):
        return batch * g.num_layers * dense_layer
    codes, kept = _kept_tokens(g, context, budget)
    if kept >= context:  # the budget (with the forced pages) covers the context: the op attends it all
        return batch * g.num_layers * dense_layer
    pages = -(-context // g.page_size)
    sparse_layer = 2 * pages * row + codes * g.num_kv_heads + 2 * kept * row
    return batch * (g.dense_layers * dense_layer + (g.num_layers - g.dense_layers) * sparse_layer)


@dataclass(frozen=True)
class StepBytes:
    weights: int
    kv: int

    @property
    def total(self) -> int:
        return self.weights + self.kv

    def share(self, seconds: float, bandwidth: float) -> float:
        """Fraction of ``bandwidth`` (bytes/s) a step of ``seconds`` reaches."""
        return self.total / seconds / bandwidth
