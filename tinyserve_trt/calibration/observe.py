"""The observe phase: ranges and page hits over calibration prompts, then a held-out check.

``calibrate(source, calib, heldout, config)`` returns a CalibrationArtifact;
it is the only code that runs the model. Held-out evaluation compares each
prompt's next-token distribution with all pages hot against the same cache
with its coldest pages fake-quantized (quantize -> dequantize, what the op
reads), chosen by the runtime's rules: sinks and recent pages stay hot, the
least-hit full pages go cold until ``hot_fraction`` is met.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from tinyserve_trt.calibration.source import ObservationSource
from tinyserve_trt.contracts.calibration import CalibrationArtifact
from tinyserve_trt.contracts.cold_tier import TierConfig, cold_page_bytes
from tinyserve_trt.ops.quantization import GRANULARITIES, dequantize_page, quantize_page
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
    """

    page_size: int = 16
    token_budget: int = 256
    decode_steps: int = 8
    sink_pages: int = 1
    recent_pages: int = 1
    hot_recent_pages: int = 2
    hot_fraction: float = 0.5
    k_granularity: str = "channel"
    v_granularity: str = "token"
    max_tokens: int = 1024
    kv_dtype: str = "float16"

    def __post_init__(self):
        for name in ("page_size", "decode_steps", "recent_pages", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("token_budget", "sink_pages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.hot_recent_pages < self.recent_pages:
            raise ValueError("hot_recent_pages must be >= recent_pages: the op reads recent pages every step")
        if not 0.0 <= self.hot_fraction <= 1.0:
            raise ValueError(f"hot_fraction must be in [0, 1], got {self.hot_fraction!r}")
        for name in ("k_granularity", "v_granularity"):
            if getattr(self, name) not in GRANULARITIES:
                raise ValueError(f"{name} must be one of {GRANULARITIES}, got {getattr(self, name)!r}")


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
    n_cold = num_pages - math.ceil(cfg.hot_fraction * num_pages)
    return sorted(eligible[: max(0, n_cold)])


def fake_quantize(cfg: CalibrationConfig, cold: Sequence[int]):
    """A KVTransform that replaces the full pages ``cold`` by their dequantized INT8 copies."""
    ps = cfg.page_size

    def transform(layer, k, v):  # [Hkv, T, D]
        k, v = k.copy(), v.copy()
        for j in cold:
            sl = slice(j * ps, (j + 1) * ps)
            if k[:, sl].shape[1] != ps:
                continue  # partial pages are never cold
            k[:, sl] = dequantize_page(*quantize_page(k[:, sl], cfg.k_granularity))
            v[:, sl] = dequantize_page(*quantize_page(v[:, sl], cfg.v_granularity))
        return k, v

    return transform


def evaluate(source: ObservationSource, prompts: Sequence[Sequence[int]], cfg: CalibrationConfig,
             progress: Progress = _no_progress) -> dict:
    """Top-1 agreement, KL(hot || mixed) and memory saved on held-out ``prompts``."""
    agree, kls, cold_pages, total_pages = [], [], 0, 0
    for ids in progress(prompts, "evaluate"):
        ctx = len(ids) - 1
        n = ctx // cfg.page_size  # full pages only can be cold
        sel = source.observe(ids[:-1]).selected_pages if ctx >= 2 else np.zeros((1, 1, 1, 1), bool)
        cold = cold_pages_for(sel, -(-ctx // cfg.page_size), cfg)
        cold = [j for j in cold if j < n]
        base = source.next_token_logits(ids)
        mixed = source.next_token_logits(ids, fake_quantize(cfg, cold)) if cold else base
        p, q = _softmax(base), _softmax(mixed)
        agree.append(float(base.argmax() == mixed.argmax()))
        kls.append(float(np.sum(p * (np.log(p + 1e-300) - np.log(q + 1e-300)))))
        cold_pages += len(cold)
        total_pages += -(-ctx // cfg.page_size)
    L, Hkv, D = source.num_layers, source.num_kv_heads, source.head_dim
    hot_b = CacheConfig.page_bytes(cfg.page_size, L, Hkv, D, cfg.kv_dtype)
    cold_b = cold_page_bytes(TierConfig(1, cfg.k_granularity, cfg.v_granularity), cfg.page_size, L, Hkv, D,
                             cfg.kv_dtype)
    share = cold_pages / max(total_pages, 1)
    return {"num_prompts": len(prompts), "cold_page_share": share,
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
    report = evaluate(source, heldout, cfg, progress) if heldout else {}
    return CalibrationArtifact(
        model=model, page_size=cfg.page_size, k_granularity=cfg.k_granularity, v_granularity=cfg.v_granularity,
        hot_fraction=cfg.hot_fraction, k_absmax=k_absmax, v_absmax=v_absmax, token_budget=cfg.token_budget,
        sink_pages=cfg.sink_pages, recent_pages=cfg.hot_recent_pages, num_prompts=len(calib),
        hit_stats=hit_stats, evaluation=report)
