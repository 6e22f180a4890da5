"""The observe phase: ranges and page hits over calibration prompts, then a held-out check.

``calibrate(source, calib, heldout, config)`` returns a CalibrationArtifact;
it is the only code that runs the model. Held-out evaluation compares each
prompt's next-token distribution with all pages hot against the same cache
with its coldest pages fake-quantized (quantize -> dequantize, what the op
reads), chosen by the runtime's rules: sinks and recent pages stay hot, the
least-hit full pages go cold until ``hot_fraction`` is met. Fake quantization is
the package's: each layer's ``ColdCodec`` (``TierConfig.layer_codecs``: INT8, or INT4
format 3 with an INT4 package's ``int8_layers`` at INT8), INT4 keys on the page's bounds
- in a two-level layer on its sub-page codes, computed from the keys as a pool does.
For INT4, ``sensitivity.layer_sensitivity`` first picks the layers to keep at INT8.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tinyserve_trt.calibration.source import ObservationSource
from tinyserve_trt.contracts.calibration import CalibrationArtifact
from tinyserve_trt.contracts.dense_layers import dense_layer_indices
from tinyserve_trt.contracts.cold_tier import (DEFAULT_HOT_FRACTION, INT4_GROUP_SIZE, TierConfig, cold_page_bytes,
                                               default_int8_layers_count)
from tinyserve_trt.ops import schema
from tinyserve_trt.ops.cold_codec import ColdCodec, page_bounds
from tinyserve_trt.ops.fine_bounds import pages_sub_bounds
from tinyserve_trt.ops.quantization import GRANULARITIES
from tinyserve_trt.runtime.config import CacheConfig

Progress = Callable[[Iterable, str], Iterable]


@dataclass(frozen=True)
class CalibrationConfig:
    """page_size / token_budget / sink_pages / recent_pages: the op settings to observe under
    (decode steps select ``token_budget // page_size`` pages).
    decode_steps: trailing positions of each prompt replayed as decode steps.
    hot_fraction: share of a sequence's pages kept hot in the evaluation and the artifact.
    hot_recent_pages: trailing pages the hotness policy keeps hot (>= recent_pages).
    max_tokens: prompts are cut to this many tokens. kv_dtype: hot-tier dtype for the memory report.
    cold_format / group_size: the package's cold codec (``contracts.cold_tier.TierConfig``).
    sub_page_size / dense_layers: two-level selection's sub-page tokens (0: single level) and the
    leading dense layers, whose nodes read the page bounds: which layers' INT4 keys quantize on
    sub-page codes (``KVStorage.keys_on_codes``).
    group_reduce / candidate_share: the sparse layers' selection rule (the op's attributes; a package's
    own, which ``replay_selection`` replays for a source without the op).
    int8_layers_count: INT4 only - how many of the most sensitive layers the artifact keeps at
    INT8 (``sensitivity.py``; 0: none, and no sensitivity pass).
    """

    page_size: int = 16
    token_budget: int = 256
    decode_steps: int = 8
    sink_pages: int = 1
    recent_pages: int = 1
    hot_recent_pages: int = 2
    hot_fraction: float | None = None  # None: DEFAULT_HOT_FRACTION of the cold format
    k_granularity: str = "channel"
    v_granularity: str = "token"
    max_tokens: int = 1024
    kv_dtype: str = "float16"
    cold_format: str = "int4"  # tinyserve-export's default for the ort backend
    group_size: int = INT4_GROUP_SIZE
    sub_page_size: int = 0
    dense_layers: int | tuple[int, ...] = 0  # a count (the leading ones) or indices: contracts.dense_layers
    int8_layers_count: int | None = None  # None: default_int8_layers_count(layers)
    group_reduce: str = field(default_factory=lambda: schema.attribute("group_reduce").default)
    candidate_share: float = field(default_factory=lambda: schema.attribute("candidate_share").default)

    def __post_init__(self):
        for name in ("page_size", "decode_steps", "recent_pages", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        dense_layer_indices(self.dense_layers)  # a count or layer indices (ValueError, one line)
        for name in ("token_budget", "sink_pages", "sub_page_size", "int8_layers_count"):
            v = getattr(self, name)
            if v is None and name == "int8_layers_count":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.hot_recent_pages < self.recent_pages:
            raise ValueError("hot_recent_pages must be >= recent_pages: the op reads recent pages every step")
        if self.hot_fraction is not None and not 0.0 <= self.hot_fraction <= 1.0:
            raise ValueError(f"hot_fraction must be in [0, 1], got {self.hot_fraction!r}")
        for name in ("k_granularity", "v_granularity"):
            if getattr(self, name) not in GRANULARITIES:
                raise ValueError(f"{name} must be one of {GRANULARITIES}, got {getattr(self, name)!r}")
        if self.sub_page_size and self.page_size % self.sub_page_size:
            raise ValueError(f"sub_page_size must divide the page size {self.page_size}, got {self.sub_page_size}")
        for name in ("group_reduce", "candidate_share"):  # the op's own checks (one line)
            schema.attribute(name).validate(getattr(self, name))
        self.tiers()  # validates cold_format / group_size

    @property
    def resolved_hot_fraction(self) -> float:
        """``hot_fraction``, else the cold format's default (``DEFAULT_HOT_FRACTION``)."""
        return DEFAULT_HOT_FRACTION[self.cold_format] if self.hot_fraction is None else self.hot_fraction

    def resolved_int8_layers_count(self, num_layers: int) -> int:
        """``int8_layers_count``, else ``default_int8_layers_count(num_layers)``."""
        return default_int8_layers_count(num_layers) if self.int8_layers_count is None else self.int8_layers_count

    def tiers(self, int8_layers=()) -> TierConfig:
        """The package's cold tier (its codecs) with ``int8_layers``."""
        k_gran = "channel" if self.cold_format == "int4" else self.k_granularity  # INT4 keys: on the bounds
        return TierConfig(1, k_gran, self.v_granularity, cold_format=self.cold_format, group_size=self.group_size,
                          int8_layers=int8_layers)

    def keys_on_codes(self, layer: int) -> bool:
        """Whether ``layer``'s node is two-level (INT4 keys quantize on its sub-page codes)."""
        return bool(self.sub_page_size and self.sub_page_size < self.page_size
                    and layer not in dense_layer_indices(self.dense_layers))


def _no_progress(it, desc):
    return it


def observe(source: ObservationSource, prompts: Sequence[Sequence[int]], cfg: CalibrationConfig,
            progress: Progress = _no_progress) -> tuple[np.ndarray, np.ndarray, dict]:
    """``(k_absmax [L, Hkv, D], v_absmax [L, Hkv], hit_stats)`` over ``prompts`` (token ids)."""
    L, Hkv, D = source.num_layers, source.num_kv_heads, source.head_dim
    k_absmax, v_absmax = np.zeros((L, Hkv, D), np.float32), np.zeros((L, Hkv), np.float32)
    hits = {"sink": 0.0, "recent": 0.0, "other": 0.0}
    top10 = []
    for ids in progress(prompts, "observe"):
        ob = source.observe(ids)
        k_absmax = np.maximum(k_absmax, np.abs(ob.keys).max(axis=2))
        v_absmax = np.maximum(v_absmax, np.abs(ob.values).max(axis=(2, 3)))
        sel = ob.selected_pages  # [steps, L, Hkv, NP]
        n_last = sel.shape[-1]
        per_page = sel.sum(axis=(0, 1, 2)).astype(np.float64)  # [NP] over steps, layers, heads
        j = np.arange(n_last)
        sink, recent = j < cfg.sink_pages, j >= n_last - cfg.recent_pages
        other = ~(sink | recent)
        hits["sink"] += per_page[sink].sum()
        hits["recent"] += per_page[recent & ~sink].sum()
        hits["other"] += per_page[other].sum()
        if other.sum() >= 10:
            o = np.sort(per_page[other])[::-1]
            top10.append(float(o[: max(1, len(o) // 10)].sum() / max(o.sum(), 1e-12)))
    total = sum(hits.values()) or 1.0
    stats = {f"{k}_share": v / total for k, v in hits.items()}
    stats["top10_share"] = float(np.mean(top10)) if top10 else None
    return k_absmax, v_absmax, stats


def cold_pages_for(selected_pages: np.ndarray, num_pages: int, cfg: CalibrationConfig) -> list[int]:
    """Logical pages of a ``num_pages``-page context the runtime would make cold (see module doc)."""
    hits = selected_pages.sum(axis=tuple(range(selected_pages.ndim - 1)))[:num_pages]
    hits = np.pad(hits.astype(np.float64), (0, max(0, num_pages - hits.shape[0])))
    protected = set(range(min(cfg.sink_pages, num_pages))) | set(range(max(0, num_pages - cfg.hot_recent_pages),
                                                                       num_pages))
    eligible = sorted((j for j in range(num_pages) if j not in protected), key=lambda j: (hits[j], j))
    n_cold = num_pages - math.ceil(cfg.resolved_hot_fraction * num_pages)
    return sorted(eligible[: max(0, n_cold)])


def fake_quantize(cfg: CalibrationConfig, cold: Sequence[int], codecs: Sequence[ColdCodec] | None = None,
                  layers: Iterable[int] | None = None):
    """A KVTransform that replaces the full pages ``cold`` by their dequantized copies, each layer
    by its codec (``codecs``, default ``cfg.tiers()``'s for every layer); ``layers``: only these
    layers' pages (None: all)."""
    ps = cfg.page_size
    only = None if layers is None else set(layers)

    def transform(layer, k, v):  # [Hkv, T, D]
        if only is not None and layer not in only:
            return k, v
        codec = cfg.tiers().codec if codecs is None else codecs[layer]
        k, v = k.copy(), v.copy()
        full = [j for j in cold if k[:, j * ps:(j + 1) * ps].shape[1] == ps]  # partial pages are never cold
        if not full:
            return k, v
        idx = np.concatenate([np.arange(j * ps, (j + 1) * ps) for j in full])
        kp = np.swapaxes(k[:, idx].reshape(k.shape[0], len(full), ps, -1), 0, 1)  # [n, Hkv, ps, D]
        vp = np.swapaxes(v[:, idx].reshape(v.shape[0], len(full), ps, -1), 0, 1)
        kq, vq = dequantized_pages(codec, kp, vp, cfg.sub_page_size if cfg.keys_on_codes(layer) else 0)
        k[:, idx] = np.swapaxes(kq, 0, 1).reshape(k.shape[0], -1, k.shape[-1]).astype(k.dtype)
        v[:, idx] = np.swapaxes(vq, 0, 1).reshape(v.shape[0], -1, v.shape[-1]).astype(v.dtype)
        return k, v

    return transform


def dequantized_pages(codec: ColdCodec, k: np.ndarray, v: np.ndarray, sub_page_size: int = 0):
    """Full pages ``k, v [n, Hkv, ps, D]`` as the op reads them after a pool demoted them with
    ``codec`` (float32): INT4 keys on the pages' own bounds, with ``sub_page_size`` on their
    sub-page codes (``fine_bounds.pages_sub_bounds`` of the keys, as a pool stores them)."""
    if codec.keys_on_bounds:
        kmin, kmax = page_bounds(k)
        codes = None
        if sub_page_size:
            codes = pages_sub_bounds(k, sub_page_size, kmin, kmax, np.full(k.shape[0], k.shape[-2]))
        kq, ks = codec.quantize(k, "k", bounds=(kmin, kmax), sub_codes=codes)
        keys = codec.dequantize_keys(kq, ks, kmin, kmax, sub_codes=codes)
    else:
        keys = codec.dequantize(*codec.quantize(k, "k"))
    return keys, codec.dequantize(*codec.quantize(v, "v"))


def heldout_cold_pages(source: ObservationSource, ids: Sequence[int], cfg: CalibrationConfig) -> list[int]:
    """The full logical pages of ``ids[:-1]`` the runtime would make cold (:func:`cold_pages_for`)."""
    ctx = len(ids) - 1
    sel = source.observe(ids[:-1]).selected_pages if ctx >= 2 else np.zeros((1, 1, 1, 1), bool)
    return [j for j in cold_pages_for(sel, -(-ctx // cfg.page_size), cfg) if j < ctx // cfg.page_size]


def kl_divergence(base: np.ndarray, other: np.ndarray) -> float:
    """KL(softmax(base) || softmax(other)) of two logit vectors."""
    p, q = _softmax(base), _softmax(other)
    return float(np.sum(p * (np.log(p + 1e-300) - np.log(q + 1e-300))))


def evaluate(source: ObservationSource, prompts: Sequence[Sequence[int]], cfg: CalibrationConfig,
             progress: Progress = _no_progress, int8_layers=()) -> dict:
    """Top-1 agreement, KL(hot || mixed) and memory saved on held-out ``prompts``, the cold pages
    in the package's codecs (``cfg.tiers(int8_layers)``)."""
    agree, kls, cold_pages, total_pages = [], [], 0, 0
    tiers = cfg.tiers(int8_layers)
    codecs = tiers.layer_codecs(source.num_layers)
    for ids in progress(prompts, "evaluate"):
        ctx = len(ids) - 1
        cold = heldout_cold_pages(source, ids, cfg)
        if cold:
            base, mixed = source.next_token_logits_many(ids, [None, fake_quantize(cfg, cold, codecs)])
        else:
            base = mixed = source.next_token_logits(ids)
        agree.append(float(base.argmax() == mixed.argmax()))
        kls.append(kl_divergence(base, mixed))
        cold_pages += len(cold)
        total_pages += -(-ctx // cfg.page_size)
    L, Hkv, D = source.num_layers, source.num_kv_heads, source.head_dim
    hot_b = CacheConfig.page_bytes(cfg.page_size, L, Hkv, D, cfg.kv_dtype)
    cold_b = cold_page_bytes(tiers, cfg.page_size, L, Hkv, D, cfg.kv_dtype)  # per-layer codecs summed
    share = cold_pages / max(total_pages, 1)
    return {"num_prompts": len(prompts), "cold_page_share": share, "cold_format": tiers.describe(),
            "memory_saved": share * (1 - cold_b / hot_b), "hot_page_bytes": hot_b, "cold_page_bytes": cold_b,
            "top1_agreement": float(np.mean(agree)) if agree else None,
            "mean_kl": float(np.mean(kls)) if kls else None, "max_kl": float(np.max(kls)) if kls else None}


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def calibrate(source: ObservationSource, calib: Sequence[Sequence[int]], heldout: Sequence[Sequence[int]],
              cfg: CalibrationConfig, model: str = "", progress: Progress = _no_progress) -> CalibrationArtifact:
    """Observe ``calib``, evaluate on ``heldout`` (token ids, already cut to ``max_tokens``)."""
    k_absmax, v_absmax, hit_stats = observe(source, calib, cfg, progress)
    layer_kl, int8_layers = [], None
    if cfg.cold_format == "int4" and heldout:  # L + 1 forwards per held-out prompt
        from tinyserve_trt.calibration.sensitivity import layer_sensitivity, most_sensitive

        count = cfg.resolved_int8_layers_count(source.num_layers)
        if count:
            layer_kl = layer_sensitivity(source, heldout, cfg, progress)
        int8_layers = most_sensitive(layer_kl, count)
    report = evaluate(source, heldout, cfg, progress, int8_layers or ()) if heldout else {}
    return CalibrationArtifact(
        model=model, page_size=cfg.page_size, k_granularity=cfg.k_granularity, v_granularity=cfg.v_granularity,
        hot_fraction=cfg.resolved_hot_fraction, k_absmax=k_absmax, v_absmax=v_absmax, token_budget=cfg.token_budget,
        sink_pages=cfg.sink_pages, recent_pages=cfg.hot_recent_pages, num_prompts=len(calib),
        hit_stats=hit_stats, evaluation=report, layer_kl=layer_kl, int8_layers=int8_layers)
