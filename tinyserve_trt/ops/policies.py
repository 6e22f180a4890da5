"""Page selection policies: an ABC, a registry, and the policies - the one list of them.

A policy scores a sequence's pages for one decode step, per query head; the
op combines a GQA group's heads (``group_reduce``), forces sinks and recent
pages in, and keeps the top pages within the token budget. Each policy
class is the one definition of its score, written three ways side by side: in
numpy (the reference), as ONNX nodes (the function body) and in torch for
every query position at once (``tinyserve_dev.evaluation``). Consumers pick a
policy through this registry (``get_policy``, ``selecting``), never by name.

The registry is the single source of the policy names: ``schema.POLICIES`` (the op's
``policy`` attribute choices), ``schema.TWO_LEVEL_POLICIES`` and the generated C header's
``QSA_POLICY_*`` ids (``schema.POLICY_IDS``: only policies with a ``native_id``) are read from
it. A policy's ``native_kernels`` says which native kernels implement its score (``cpu``: the
ORT CPU node, ``cuda``: the CUDA kernels / TensorRT plugin); the others refuse it and the op
runs as its ONNX function there (the runtime's kernel report says why). Adding a policy is a
class here (no ``native_id``: the header does not change), its test, and ``docs/op.md``'s
regenerated table (``python -m tinyserve_dev.doc_tables docs/op.md``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

NATIVE_KERNELS = ("cpu", "cuda")  # the native implementations a policy may name in ``native_kernels``


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
    native_id: int | None = None  # its QSA_POLICY_* value in the generated C header; None: C knows it not
    native_kernels: tuple[str, ...] = ()  # NATIVE_KERNELS implementing it (each needs a native_id)

    @abstractmethod
    def score_ref(self, q, key_min, key_max, keys, new_key, page_size: int, scale: float) -> np.ndarray:
        """Per-head page scores ``[G, n]`` (float64) for one sequence and KV head.

        q: [G, D] the group's queries; key_min/key_max: [n, D];
        keys: [past_len, D] the cached keys; new_key: [D]. Does not modify inputs.
        """

    @abstractmethod
    def score_onnx(self, ctx: OnnxScoreContext) -> str:
        """ONNX tensor of per-head scores ``[B, Hkv, G*S, NP]`` (broadcastable)."""

    def sub_page_score_onnx(self, builder, qg: str, coarse: str, codes: str, step: str, group_reduce,
                            dims: dict | None = None) -> str:
        """Sub-page scores ``[B, Hkv, K1, r]`` for two-level selection, from the candidate pages'
        per-head coarse scores ``coarse [B, Hkv, G*S, K1]`` and their compact bounds
        (``fine_bounds``: ``codes`` uint8 ``[B, Hkv, K1, r, D]``,
        ``lo = key_min + (codes & 15) * step``, ``hi = key_max - (codes >> 4) * step``,
        ``step [B, Hkv, K1, 1, D]`` float32); ``group_reduce(x, axis)`` combines the per-head
        scores of a group (the op's ``group_reduce``) on the G*S axis of ``x``. ``dims``: optional
        ``[1]``/``[2]`` int64 values ``bh`` (B, Hkv), ``k1``, ``r``, ``d``, ``gs`` (G*S) computed per step
        outside the layer (else read from the codes' and queries' shapes, per layer).
        Only the policies in ``schema.TWO_LEVEL_POLICIES`` (:func:`two_level`) define it."""
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
    """Add ``cls`` (one instance) to the registry; ValueError on a repeated name or C id, or a native
    kernel without an id (the C code could not be told the policy)."""
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"policy name {cls.name!r} is empty or registered twice")
    if cls.native_id is not None and cls.native_id in native_ids().values():
        raise ValueError(f"policy {cls.name!r}: native_id {cls.native_id} is taken")
    if any(k not in NATIVE_KERNELS for k in cls.native_kernels) or (cls.native_kernels and cls.native_id is None):
        raise ValueError(f"policy {cls.name!r}: native_kernels {cls.native_kernels} must be from {NATIVE_KERNELS} "
                         "and need a native_id")
    _REGISTRY[cls.name] = cls()
    return cls


def get_policy(name: str) -> SelectionPolicy:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown selection policy {name!r}; known: {sorted(_REGISTRY)}") from None


def registered() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def native_ids() -> dict[str, int]:
    """name -> the ``QSA_POLICY_*`` id of every policy the C code knows (``native_id`` set)."""
    return {name: p.native_id for name, p in _REGISTRY.items() if p.native_id is not None}


def implemented_by(kernel: str) -> tuple[str, ...]:
    """Names of the policies native ``kernel`` (``NATIVE_KERNELS``) implements; it refuses the others."""
    if kernel not in NATIVE_KERNELS:
        raise ValueError(f"kernel must be one of {NATIVE_KERNELS}, got {kernel!r}")
    return tuple(name for name, p in _REGISTRY.items() if kernel in p.native_kernels)


def two_level() -> tuple[str, ...]:
    """Names of the policies with a two-level (sub-page) score (``sub_page_score_onnx`` defined)."""
    return tuple(name for name, p in _REGISTRY.items()
                 if type(p).sub_page_score_onnx is not SelectionPolicy.sub_page_score_onnx)


def selecting() -> tuple[str, ...]:
    """Names of the policies that select pages (all but ``dense``), e.g. a CLI's choices."""
    return tuple(name for name, policy in _REGISTRY.items() if policy.selects)


@register
class QueryAware(SelectionPolicy):
    """Quest: ``sum_i max(q_i * min_i, q_i * max_i)``, an upper bound of q.k in the page."""

    name = "query_aware"
    native_id = 0
    native_kernels = ("cpu", "cuda")

    def score_ref(self, q, key_min, key_max, keys, new_key, page_size, scale):
        return np.maximum(q[:, None, :] * key_min[None], q[:, None, :] * key_max[None]).sum(-1)

    def score_onnx(self, ctx):
        b = ctx.builder
        kmin_t, kmax_t = ctx.key_minmax_T()
        # max(q*lo, q*hi) = relu(q)*hi + min(q,0)*lo: two MatMuls instead of a [.., NP, D] product.
        q_pos = b.op("Relu", ctx.qg)
        q_neg = b.op("Sub", ctx.qg, q_pos)
        return b.op("Add", b.op("MatMul", q_pos, kmax_t), b.op("MatMul", q_neg, kmin_t))

    def sub_page_score_onnx(self, builder, qg, coarse, codes, step, group_reduce, dims=None):
        # With lo = min + lo_c*step and hi = max - hi_c*step the bound is the page's own
        # relu(q).max + min(q,0).min (coarse) + sum_d (min(q,0)_d*lo_c - relu(q)_d*hi_c)*step_d,
        # and lo_c = code - 16*hi_c: two MatMuls over code*step and hi_c*step, no decoded lo/hi
        # tensors. Each level times step rounds once, as a Cast and a Mul would, so the scores
        # equal score_ref on the decoded bounds up to float32 rounding (as the coarse MatMuls
        # do); the reference and the CUDA kernel keep the decoded form. The MatMuls put the G*S
        # query rows first (the other way round N = G*S is tiny and the GEMM pads it).
        from .fine_bounds import BITS

        b = builder
        q_pos = b.op("Relu", qg)
        q_neg = b.op("Sub", qg, q_pos)
        w_hi = b.op("Neg", b.op("Add", q_pos, b.op("Mul", q_neg, b.const(float(1 << BITS), np.float32))))
        if b.opset >= BLOCKED_DQ_OPSET:
            return _levels_blocked(b, q_neg, w_hi, coarse, codes, step, group_reduce, dims)
        # Opset < 21 (the legacy exporter's 17), measured fastest in ORT CPU of the forms tried
        # (benchmarks/bench_two_level_stage2.py): the (uint8) codes go sub-page-major, so the
        # per-page step broadcasts over the leading axis (over the inner r axis it runs one short
        # span per (page, sub-page), ~1.5x slower), hi_c = Floor(c / 16) (exact: c <= 255).
        c = b.op("Cast", b.op("Transpose", codes, perm=[3, 0, 1, 2, 4]), to=_FLOAT)  # [r, B, Hkv, K1, D]
        hi_c = b.op("Floor", b.op("Mul", c, b.const(1.0 / (1 << BITS), np.float32)))
        step4 = b.op("Squeeze", step, b.const([3], np.int64, "ax"))  # [B, Hkv, K1, D]

        def term(w, levels):  # w [B, Hkv, G*S, D] (broadcast over r) -> [r, B, Hkv, G*S, K1]
            return b.op("MatMul", w, b.op("Transpose", b.op("Mul", levels, step4), perm=[0, 1, 2, 4, 3]))
        per_head = b.op("Add", b.op("Add", term(q_neg, c), term(w_hi, hi_c)), coarse)  # [r, B, Hkv, G*S, K1]
        return b.op("Transpose", group_reduce(per_head, 3), perm=[1, 2, 3, 0])  # [B, Hkv, K1, r]

    def score_torch(self, q, key_min, key_max, page_mass):
        # the ONNX body's two-MatMul form of max(q*lo, q*hi)
        return q.clamp(min=0) @ key_max[:, None].transpose(-1, -2) + q.clamp(max=0) @ key_min[:, None].transpose(-1, -2)


_FLOAT, _UINT8 = 1, 2  # TensorProto element types
BLOCKED_DQ_OPSET = 21  # DequantizeLinear's block_size (blocked quantization) appears in opset 21
_WHOLE_AXIS = 1 << 30  # a block_size >= r: one scale row [.., 1, D] serves all of a page's sub-pages


def _levels_blocked(b, q_neg, w_hi, coarse, codes, step, group_reduce, dims=None):
    """Opset >= 21: code*step and hi_c*step each one DequantizeLinear from the uint8 codes (a scale
    block spanning the r axis) instead of Cast, Mul and Floor passes over [r, B, Hkv, K1, D]
    floats, and no Transpose: 0.66x the opset-17 form's time in ORT CPU at 8K, batch 1 and 8
    (benchmarks/results/two_level_stage2_microbench.md). hi_c = Cast(code / 16 -> uint8): the
    division is exact and the cast truncates. Returns ``[B, Hkv, K1, r]``."""
    levels = b.op("DequantizeLinear", codes, step, axis=3, block_size=_WHOLE_AXIS)
    hi_c = b.op("Cast", b.op("DequantizeLinear", codes, b.const(1.0 / 16, np.float32)), to=_UINT8)
    if dims is None:  # B, Hkv, K1, r, D (no -1 in the reshapes: K1 may be 0)
        shape = b.dim(codes, 0, 5)
        bh, k1, r, d = (b.op("Slice", shape, b.const([i], np.int64, "i"), b.const([j], np.int64, "i")) for i, j in
                        ((0, 2), (2, 3), (3, 4), (4, 5)))
        gs = b.dim(w_hi, 2)
    else:  # per-step values from outside the layer: no Shape/Slice chain per layer
        bh, k1, r, d, gs = (dims[k] for k in ("bh", "k1", "r", "d", "gs"))
    rows = b.op("Concat", bh, b.op("Mul", k1, r), d, axis=0)

    def term(w, x):  # [B, Hkv, G*S, D] x [B, Hkv, D, K1*r]
        return b.op("MatMul", w, b.op("Transpose", b.op("Reshape", x, rows), perm=[0, 1, 3, 2]))
    hi = b.op("DequantizeLinear", hi_c, step, axis=3, block_size=_WHOLE_AXIS)
    s = b.op("Add", term(q_neg, levels), term(w_hi, hi))  # [B, Hkv, G*S, K1*r]
    s = b.op("Reshape", s, b.op("Concat", bh, gs, k1, r, axis=0))
    per_head = b.op("Add", s, b.unsqueeze(coarse, [4]))  # [B, Hkv, G*S, K1, r]
    return group_reduce(per_head, 2)


@register
class Window(SelectionPolicy):
    """StreamingLLM-style: sinks plus the most recent pages (score = page position)."""

    name = "window"
    native_id = 1
    native_kernels = ("cuda",)

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
    native_id = 2
    native_kernels = ("cpu", "cuda")

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
    native_id = 3  # the CUDA API knows the id and refuses it (it needs the dense scores)

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


@register
class KeySpread(SelectionPolicy):
    """A query-blind baseline: the pages whose keys spread most, ``sum_d (max_d - min_d)``.
    No native kernel implements it (no ``native_id``): the op runs as its ONNX function."""

    name = "key_spread"

    def score_ref(self, q, key_min, key_max, keys, new_key, page_size, scale):
        spread = (key_max.astype(np.float64) - key_min.astype(np.float64)).sum(-1)
        return np.broadcast_to(spread, (q.shape[0], key_min.shape[0]))

    def score_onnx(self, ctx):
        b = ctx.builder
        kmin_t, kmax_t = ctx.key_minmax_T()  # [B, Hkv, D, NP]
        return b.op("ReduceSum", b.op("Sub", kmax_t, kmin_t), b.const([2], np.int64, "ax"), keepdims=1)

    def score_torch(self, q, key_min, key_max, page_mass):
        spread = (key_max - key_min).sum(-1)  # [Hkv, NP]
        return spread[:, None, None, :].expand(*q.shape[:3], key_min.shape[1])


def reduce_group(scores: np.ndarray, how: str) -> np.ndarray:
    """Combine per-head scores ``[G, n]`` into one per KV head ``[n]`` ("head": each query head
    selects alone - the caller passes one head's scores, ``[1, n]``)."""
    if how == "head":
        if scores.shape[0] != 1:
            raise ValueError(f"group_reduce 'head' scores one query head at a time, got {scores.shape[0]}")
        return scores[0]
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
