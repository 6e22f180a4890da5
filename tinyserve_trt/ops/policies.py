"""Page selection policies: an ABC, a registry, and the four policies.

A policy scores a sequence's pages for one decode step, per query head; the
op combines a GQA group's heads (``group_reduce``), forces sinks and recent
pages in, and keeps the top pages within the token budget. Each policy
class is the one definition of its score, written three ways side by side: in
numpy (the reference), as ONNX nodes (the function body) and in torch for
every query position at once (``tinyserve_dev.evaluation``). Consumers pick a
policy through this registry (``get_policy``, ``selecting``), never by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from . import schema


@dataclass
class OnnxScoreContext:
    """Tensors of the function body a policy may read (all float32 unless noted).

    qg: [B, Hkv, G*S, D] queries grouped by KV head.
    page_idx_f: [1, 1, 1, NP] logical page index as float.
    Callables build shared subgraphs lazily so unused ones cost nothing.
    """

    builder: object
    qg: str
    page_idx_f: str
    key_minmax_T: object  # () -> (kmin_T, kmax_T), each [B, Hkv, D, NP]
    dense_page_mass: object  # () -> [B, Hkv, G*S, NP] exact attention mass per page


class SelectionPolicy(ABC):
    """Scores pages; larger means more worth keeping."""

    name: str = ""
    selects: bool = True  # False: every page is kept (dense)
    reads_attention_mass: bool = False  # True: the score needs the dense attention (oracle)

    @abstractmethod
    def score_ref(self, q, key_min, key_max, keys, new_key, page_size: int, scale: float) -> np.ndarray:
        """Per-head page scores ``[G, n]`` (float64) for one sequence and KV head.

        q: [G, D] the group's queries; key_min/key_max: [n, D];
        keys: [past_len, D] the cached keys; new_key: [D]. Does not modify inputs.
        """

    @abstractmethod
    def score_onnx(self, ctx: OnnxScoreContext) -> str:
        """ONNX tensor of per-head scores ``[B, Hkv, G*S, NP]`` (broadcastable)."""

    def sub_page_score_onnx(self, builder, qg: str, coarse: str, codes: str, step: str) -> str:
        """Per-head sub-page scores ``[r, B, Hkv, G*S, K1]`` for two-level selection, from the
        candidate pages' per-head coarse scores ``coarse [B, Hkv, G*S, K1]`` and their compact
        bounds (``fine_bounds``: ``codes`` uint8 ``[B, Hkv, K1, r, D]``,
        ``lo = key_min + (codes & 15) * step``, ``hi = key_max - (codes >> 4) * step``,
        ``step [B, Hkv, K1, 1, D]`` float32).
        Only the policies in ``schema.TWO_LEVEL_POLICIES`` define it."""
        raise ValueError(f"policy {self.name!r} has no two-level (sub-page) score")

    @abstractmethod
    def score_torch(self, q, key_min, key_max, page_mass):
        """Per-head scores ``[Hkv, G, C, NP]`` (torch) for ``C`` decode positions at once.

        q: [Hkv, G, C, D]; key_min/key_max: [Hkv, NP, D]; page_mass: [Hkv, G, C, NP] the
        dense attention mass per page (read only when ``reads_attention_mass``; else may
        be None). The same score as :meth:`score_ref`, up to float rounding.
        """


_REGISTRY: dict[str, SelectionPolicy] = {}


def register(cls):
    _REGISTRY[cls.name] = cls()
    return cls


def get_policy(name: str) -> SelectionPolicy:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown selection policy {name!r}; known: {sorted(_REGISTRY)}") from None


def registered() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def selecting() -> tuple[str, ...]:
    """Names of the policies that select pages (all but ``dense``), e.g. a CLI's choices."""
    return tuple(name for name, policy in _REGISTRY.items() if policy.selects)


@register
class QueryAware(SelectionPolicy):
    """Quest: ``sum_i max(q_i * min_i, q_i * max_i)``, an upper bound of q.k in the page."""

    name = "query_aware"

    def score_ref(self, q, key_min, key_max, keys, new_key, page_size, scale):
        return np.maximum(q[:, None, :] * key_min[None], q[:, None, :] * key_max[None]).sum(-1)

    def score_onnx(self, ctx):
        b = ctx.builder
        kmin_t, kmax_t = ctx.key_minmax_T()
        # max(q*lo, q*hi) = relu(q)*hi + min(q,0)*lo: two MatMuls instead of a [.., NP, D] product.
        q_pos = b.op("Relu", ctx.qg)
        q_neg = b.op("Sub", ctx.qg, q_pos)
        return b.op("Add", b.op("MatMul", q_pos, kmax_t), b.op("MatMul", q_neg, kmin_t))

    def sub_page_score_onnx(self, builder, qg, coarse, codes, step):
        # With lo = min + lo_c*step and hi = max - hi_c*step the bound is the page's own
        # relu(q).max + min(q,0).min (coarse) + sum_d (min(q,0)_d*lo_c - relu(q)_d*hi_c)*step_d,
        # and lo_c = code - 16*hi_c: two MatMuls over the scaled code and hi_c, no decoded
        # lo/hi tensors. Layout for ORT CPU: the (uint8) codes go sub-page-major first, so the
        # per-page step broadcasts over the leading axis (a broadcast over the inner r axis runs
        # one short span per (page, sub-page), ~2x slower), and the MatMuls put the G*S query
        # rows first (the other way round N = G*S is tiny and the GEMM pads it). Equal to
        # score_ref on the decoded bounds up to float32 rounding (as the coarse MatMuls are);
        # the reference and the CUDA kernel keep the decoded form.
        from onnx import TensorProto

        from .fine_bounds import BITS

        b = builder
        c = b.op("Cast", b.op("Transpose", codes, perm=[3, 0, 1, 2, 4]), to=TensorProto.FLOAT)  # [r, B, Hkv, K1, D]
        hi_c = b.op("Floor", b.op("Mul", c, b.const(1.0 / (1 << BITS), np.float32)))  # exact: c <= 255
        step4 = b.op("Squeeze", step, b.const([3], np.int64, "ax"))  # [B, Hkv, K1, D]
        q_pos = b.op("Relu", qg)
        q_neg = b.op("Sub", qg, q_pos)
        w_hi = b.op("Neg", b.op("Add", q_pos, b.op("Mul", q_neg, b.const(float(1 << BITS), np.float32))))

        def term(w, levels):  # w [B, Hkv, G*S, D] (broadcast over r) -> [r, B, Hkv, G*S, K1]
            return b.op("MatMul", w, b.op("Transpose", b.op("Mul", levels, step4), perm=[0, 1, 2, 4, 3]))
        return b.op("Add", b.op("Add", term(q_neg, c), term(w_hi, hi_c)), coarse)  # [r, B, Hkv, G*S, K1]

    def score_torch(self, q, key_min, key_max, page_mass):
        # the ONNX body's two-MatMul form of max(q*lo, q*hi)
        return q.clamp(min=0) @ key_max[:, None].transpose(-1, -2) + q.clamp(max=0) @ key_min[:, None].transpose(-1, -2)


@register
class Window(SelectionPolicy):
    """StreamingLLM-style: sinks plus the most recent pages (score = page position)."""

    name = "window"

    def score_ref(self, q, key_min, key_max, keys, new_key, page_size, scale):
        return np.broadcast_to(np.arange(key_min.shape[0], dtype=np.float64), (q.shape[0], key_min.shape[0]))

    def score_onnx(self, ctx):
        return ctx.page_idx_f

    def score_torch(self, q, key_min, key_max, page_mass):
        import torch

        return torch.arange(key_min.shape[1], dtype=q.dtype).expand(*q.shape[:3], key_min.shape[1])


@register
class Dense(SelectionPolicy):
    """Every page is kept; the op is exact attention."""

    name = "dense"
    selects = False

    def score_ref(self, q, key_min, key_max, keys, new_key, page_size, scale):
        return np.zeros((q.shape[0], key_min.shape[0]))

    def score_onnx(self, ctx):
        return ctx.page_idx_f

    def score_torch(self, q, key_min, key_max, page_mass):
        return q.new_zeros((*q.shape[:3], key_min.shape[1]))


@register
class Oracle(SelectionPolicy):
    """Exact attention mass of each page (needs every key: evaluation only, not fast)."""

    name = "oracle"
    reads_attention_mass = True

    def score_ref(self, q, key_min, key_max, keys, new_key, page_size, scale):
        n = key_min.shape[0]
        logits = np.concatenate([q @ keys.T, (q @ new_key)[:, None]], axis=1) * scale
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        mass = np.zeros((q.shape[0], n * page_size))
        mass[:, : keys.shape[0]] = p[:, :-1]
        return mass.reshape(q.shape[0], n, page_size).sum(-1)

    def score_onnx(self, ctx):
        return ctx.dense_page_mass()

    def score_torch(self, q, key_min, key_max, page_mass):
        if page_mass is None:
            raise ValueError("the oracle policy scores pages by the dense attention mass; pass page_mass")
        return page_mass


if set(registered()) != set(schema.POLICIES):  # the schema is the contract; fail at import if they drift
    raise RuntimeError(f"policy registry {registered()} does not match schema.POLICIES {schema.POLICIES}")


def reduce_group(scores: np.ndarray, how: str) -> np.ndarray:
    """Combine per-head scores ``[G, n]`` into one per KV head ``[n]``."""
    if how == "max":
        return scores.max(axis=0)
    if how == "sum":
        return scores.sum(axis=0)
    raise ValueError(f"unknown group_reduce {how!r}")


def select_pages(scores: np.ndarray, budget: int, page_size: int, sink_pages: int, recent_pages: int) -> np.ndarray:
    """Which of a sequence's ``n`` pages a decode step attends (bool ``[n]``).

    Forced: the first ``sink_pages`` and last ``recent_pages`` pages. The budget
    covers them: ``max(budget // page_size, forced)`` pages are kept in all;
    the rest of that count are the best-scored other pages. budget <= 0, or a
    budget that covers every page, keeps everything.
    """
    n = scores.shape[0]
    idx = np.arange(n)
    forced = (idx < sink_pages) | (idx >= n - recent_pages)
    keep_n = max(budget // page_size, int(forced.sum()))
    if budget <= 0 or keep_n >= n:
        return np.ones(n, dtype=bool)
    keep = forced.copy()
    rest = np.flatnonzero(~forced)
    order = rest[np.argsort(-scores[rest], kind="stable")]
    keep[order[: keep_n - int(forced.sum())]] = True
    return keep
