"""ObservationSource: what calibration needs from a model, as a swap point.

A source runs one prompt and returns its per-layer K/V (after rotary) and the
op's page selections at decode steps; for evaluation it returns next-token
logits with some pages' K/V replaced (fake-quantized). Registry + factory:

  hf      transformers ``AutoModelForCausalLM`` in torch (``hf_source.py``); the
          op is not in its graph, so selections are computed by the numpy
          reference policies on the captured queries and keys.
  engine  TODO (issue #6 follow-up): the tinyserve runtime engine, whose op
          reports ``selected_pages`` directly. Not implemented.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class Observation:
    """One prompt of ``T`` tokens.

    keys / values:  ``[L, Hkv, T, D]`` float32, keys after rotary (what the cache holds).
    selected_pages: ``[steps, L, Hkv, NP]`` bool, the logical pages the op attended at each
                    observed decode step (``NP`` = pages of the longest step's context).
    """

    keys: np.ndarray
    values: np.ndarray
    selected_pages: np.ndarray


# (layer, keys [Hkv, T, D], values [Hkv, T, D]) -> modified (keys, values)
KVTransform = Callable[[int, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


class ObservationSource(ABC):
    """A model seen by calibration. ``num_layers``, ``num_kv_heads``, ``head_dim`` describe its cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of one prompt."""

    @abstractmethod
    def observe(self, token_ids: Sequence[int]) -> Observation:
        """Run the prompt; K/V of every token and the selections of its last decode steps."""

    @abstractmethod
    def next_token_logits(self, token_ids: Sequence[int], transform: KVTransform | None = None) -> np.ndarray:
        """``[vocab]`` float64 logits after ``token_ids``; the cache of all but the last token
        passes through ``transform`` first (None: untouched)."""


SOURCES: dict[str, Callable[..., ObservationSource]] = {}


def register_source(name: str):
    def deco(factory):
        SOURCES[name] = factory
        return factory
    return deco


def make_source(name: str, model_dir: str, **kwargs) -> ObservationSource:
    """The source registered as ``name``; ValueError if unknown."""
    if name == "hf" and "hf" not in SOURCES:
        from tinyserve_trt.calibration import hf_source  # noqa: F401,PLC0415 (registers; imports torch)
    if name not in SOURCES:
        raise ValueError(f"unknown calibration source {name!r}; choose from {sorted(set(SOURCES) | {'hf'})}")
    return SOURCES[name](model_dir, **kwargs)
