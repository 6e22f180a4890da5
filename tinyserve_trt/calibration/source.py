"""ObservationSource: what calibration needs from a model, as a swap point.

A source runs one prompt and returns its per-layer K/V (after rotary) and the
op's page selections at decode steps; for evaluation it returns next-token
logits with some pages' K/V replaced (fake-quantized). Registry + factory:

  hf      transformers ``AutoModelForCausalLM`` in torch (``hf_source.py``); the
          op is not in its graph, so selections are computed by the numpy
          reference policies on the captured queries and keys.
  engine  a tinyserve package on the runtime's engine, ONNX Runtime backend
          (``engine_source.py``); K/V read from its page pool, selections from
          the op's ``selected_pages`` output.

``detect_source`` picks one for a directory: a package (``tinyserve.json``) ->
``engine``, a Hugging Face model directory (``config.json``) -> ``hf``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

import numpy as np

from tinyserve_trt.contracts.manifest import MANIFEST_FILE


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
    max_context: int | None = None  # longest token sequence it runs (None: no limit); prompts are cut to it

    def op_settings(self) -> dict:
        """``CalibrationConfig`` fields the source fixes (``page_size``, ``token_budget``,
        ``sink_pages``, ``recent_pages``, ``kv_dtype``): the op settings its observations were made
        under and the cache dtype it holds."""
        return {}

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

    def next_token_logits_many(self, token_ids: Sequence[int],
                               transforms: Sequence[KVTransform | None]) -> list[np.ndarray]:
        """:meth:`next_token_logits` for each of ``transforms`` over one prompt. The built-in
        sources run the prompt once and only the last token per transform (the layer sensitivity
        pass asks for ``L + 1`` of them)."""
        return [self.next_token_logits(token_ids, t) for t in transforms]

    def tail_logits_many(self, token_ids: Sequence[int], transforms: Sequence[KVTransform | None],
                         positions: int) -> list[np.ndarray]:
        """Per transform ``[positions, vocab]``: the next-token logits at each of the last ``positions``
        tokens, the first ``T - positions`` cached tokens passed through the transform. This default
        runs one prefix per position, the tail tokens before it cached as the prefill computed them;
        the engine source prefills once and reruns the tail as decode steps per transform, so their
        K/V are computed over the transformed cache (as when decoding after the pages went cold).
        The first row is the same either way."""
        T = len(token_ids)
        if not isinstance(positions, int) or not 1 <= positions <= T - 1:
            raise ValueError(f"positions must be in [1, {T - 1}], got {positions!r}")
        rows = [self.next_token_logits_many(token_ids[: T - positions + 1 + i], transforms) for i in range(positions)]
        return [np.stack([row[j] for row in rows]) for j in range(len(transforms))]


SOURCES: dict[str, Callable[..., ObservationSource]] = {}
# built-in sources register when their module is imported (heavy imports: torch, onnxruntime)
_MODULES = {"hf": "tinyserve_trt.calibration.hf_source", "engine": "tinyserve_trt.calibration.engine_source"}


def register_source(name: str):
    def deco(factory):
        SOURCES[name] = factory
        return factory
    return deco


def source_names() -> list[str]:
    return sorted(set(SOURCES) | set(_MODULES))


def detect_source(model_dir) -> str:
    """``engine`` for a tinyserve package, ``hf`` for a Hugging Face model directory;
    ValueError (one line) for anything else."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"{path}: no such directory")
    if (path / MANIFEST_FILE).is_file():
        return "engine"
    if (path / "config.json").is_file():
        return "hf"
    raise ValueError(f"{path} is neither a tinyserve package (no {MANIFEST_FILE}) nor a Hugging Face model "
                     "directory (no config.json)")


def make_source(name: str, model_dir: str, **kwargs) -> ObservationSource:
    """The source registered as ``name``; ValueError if unknown."""
    if name in _MODULES and name not in SOURCES:
        import_module(_MODULES[name])  # registers it
    if name not in SOURCES:
        raise ValueError(f"unknown calibration source {name!r}; choose from {source_names()}")
    return SOURCES[name](model_dir, **kwargs)
