"""Export options: one frozen dataclass; the CLI takes its defaults from here."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ..contracts.budget import DecodeBudget
from ..contracts.cold_tier import check_int8_layers
from ..contracts.dense_layers import dense_layer_indices
from ..ops import policies, schema

BACKENDS = ("ort", "trt")
# The default selection (issue #15), chosen by benchmarks/quality_sweep.py at budget 1024 on two
# texts (benchmarks/results/analysis.md, "Two-level default"): the cheapest setting within 2% of
# dense perplexity on both. Two-level is the default of every package with a two-level policy
# (ONNX Runtime and TensorRT: the plugin takes key_sub_bounds, the engine profile covers it).
DEFAULT_PAGE_SIZE = 32
DEFAULT_SUB_PAGE_SIZE = 4
# Per-query-head selection over every page's sub-pages, at 1/8 of the context and at least 1024
# tokens (issue #31): chosen with the torch probe on KJV Genesis at 8K and 16K on Qwen2.5-Coder-0.5B
# (GQA 14:2), checked on Hamlet (benchmarks/results/selection_probe.md, long_context.md "Session 18
# probe"): the shared two-level default cost 5-6% at 8K and 9-17% at 16K; per head with every page a
# candidate 0.7-1.3% at 8K and, at 2048 = 1/8 of 16K, 1.5% (KJV) / -0.9% (Hamlet). Every backend's
# default: the CUDA kernels select per query head too (a selection unit per query head,
# plugins/kernels/qsa_common.cuh; checked in the CPU emulation, not yet on a GPU).
DEFAULT_GROUP_REDUCE = "head"
DEFAULT_CANDIDATE_SHARE = 1.0
DEFAULT_TOKEN_BUDGET = 1024
DEFAULT_BUDGET_SHARE = 0.125
INT8_LAYER_CHOICES = ("auto", "dense", "none")  # or layer indices (ExportConfig.int8_layers)


FALLBACK_MAX_CONTEXT = 8192  # a source without a config.json that says its context
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def model_max_context(source: Path) -> int | None:
    """The context the model was trained for, from the ``config.json`` beside ``source`` (what
    transformers, optimum and our GGUF / HF conversion write); None without one."""
    import json

    try:
        data = json.loads((Path(source).parent / "config.json").read_text())
    except (OSError, ValueError):
        return None
    data = data.get("text_config", data) if isinstance(data, dict) else {}
    for key in CONTEXT_KEYS:
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def resolve_max_context(config: ExportConfig, source: Path) -> tuple[ExportConfig, str]:
    """``config`` with ``max_context`` set, and where it came from (for the summary)."""
    if config.max_context is not None:
        return config, "--max-context"
    found = model_max_context(source)
    if found is not None:
        return replace(config, max_context=found), "the model's config.json"
    return replace(config, max_context=FALLBACK_MAX_CONTEXT), "no config.json beside the model says; --max-context N"


@dataclass(frozen=True)
class ExportConfig:
    page_size: int | str = DEFAULT_PAGE_SIZE  # or "auto"
    token_budget: int = DEFAULT_TOKEN_BUDGET  # the runtime's default decode budget, its floor (0 = dense)
    budget_share: float = DEFAULT_BUDGET_SHARE  # ... and its share of the context above it (contracts.budget)
    # layers kept dense: the leading N (Quest keeps 2), or layer indices (contracts.dense_layers)
    dense_layers: int | tuple[int, ...] = 2
    policy: str = "query_aware"
    sink_pages: int = 1
    recent_pages: int = 1
    # the longest context the package serves (sizes page_size="auto", the engine profile, the runtime's
    # request limit); None: the model's own (config.json beside it: max_position_embeddings), else
    # FALLBACK_MAX_CONTEXT (``resolve_max_context``)
    max_context: int | None = None
    fp16: bool = False  # FP16 KV pages whatever the source's dtype
    fp32_kv: bool = False  # float32 KV pages whatever the source's dtype (default: the source's cache dtype)
    validate: bool = True
    backend: str = "ort"
    validate_tolerance: float | None = None  # max |logit diff|; None: 1e-4 fp32, 5e-2 fp16 pages
    last_token_logits: bool = True
    # Cold pages (issues #6, #17): the op's ``_int8``/``_int4`` overload and the cold-pool
    # inputs per layer. ``calibration`` (a tinyserve-calibrate artifact) implies ``cold_pages``
    # and supplies the scale granularities and the hot/cold policy parameters. ``cold_format``
    # None = int4 for the ort backend: at page size 16 an FP16 package's INT8 cold page still
    # costs 0.60 of a hot one (INT4 format 3: 0.35), so INT8 cannot reach 0.55 of all-FP16 KV bytes
    # (docs/mixed_precision.md); int8 for trt (INT4 is in the CUDA kernels and the plugin,
    # checked in the CPU emulation, but not yet run end to end on a GPU: ask for it explicitly).
    cold_pages: bool = False
    calibration: str | None = None
    cold_format: str | None = None
    # INT4 packages only (issue #17): layers whose cold pages stay INT8 - "auto" (the export runs
    # the layer sensitivity pass on its own all-INT4 package over the built-in text: auto_int8.py),
    # "dense" (the leading ``dense_layers``), "none", or layer indices. None: the calibration
    # artifact's ``int8_layers`` (its per-layer sensitivity pass) when an artifact is given, else
    # "auto". Which layers matter is a property of the model, not of the dense ones: on SmolLM2
    # INT8 dense layers leave the all-INT4 KL unchanged (7.1e-4 vs 7.2e-4) while INT8 for the 3
    # layers calibration ranks first cuts it by 79% (benchmarks/results/int4_layer_sensitivity.md).
    int8_layers: str | tuple | None = None
    # Two-level selection (issue #15): sparse layers re-rank the candidate pages' sub-pages of
    # this many tokens, from a ``key_sub_bounds`` input per layer. 0 (or the page size): off.
    # None: the default (``resolved_sub_page_size``).
    sub_page_size: int | None = None
    candidate_share: float = DEFAULT_CANDIDATE_SHARE
    # How a GQA group selects: "head" (each query head its own pages), "max" / "sum" (one selection
    # per KV head); None: DEFAULT_GROUP_REDUCE
    group_reduce: str | None = None
    # model.ort.onnx decodes on the op's native CPU kernel (an ORT custom op built with the host
    # C++ compiler on first use: tinyserve_trt/cpu, export/native_decode.py) where it validates;
    # False, or no compiler: the ONNX function decodes too.
    native_decode: bool = True
    # One MatMul (+ Split) per group of projections that read the same activation: QKV,
    # gate/up (``pack_matmuls.py``); the packed weights replace the originals.
    pack_projections: bool = True

    def __post_init__(self):
        if self.page_size != "auto" and (not isinstance(self.page_size, int) or self.page_size < 1
                                         or self.page_size & (self.page_size - 1)):
            raise ValueError(f"page_size must be a power of two or 'auto', got {self.page_size!r}")
        DecodeBudget(self.token_budget, self.budget_share)  # ValueError, one line
        if self.group_reduce is not None and self.group_reduce not in schema.GROUP_REDUCTIONS:
            raise ValueError(f"group_reduce must be one of {schema.GROUP_REDUCTIONS}, got {self.group_reduce!r}")
        indices = dense_layer_indices(self.dense_layers)  # ValueError, one line, for a bad value
        if not isinstance(self.dense_layers, int):  # indices: sorted, a tuple (the config stays hashable)
            object.__setattr__(self, "dense_layers", indices)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "trt" and self.policy not in policies.implemented_by("cuda"):
            raise ValueError(f"policy {self.policy!r} has no CUDA kernel, so a TensorRT engine cannot run it "
                             f"(CUDA policies: {', '.join(policies.implemented_by('cuda'))}); export it with "
                             f"--backend ort, where it runs as the op's ONNX function")
        if self.max_context is not None and (not isinstance(self.max_context, int) or self.max_context < 1):
            raise ValueError(f"max_context must be a positive integer, got {self.max_context!r}")
        if self.fp16 and self.fp32_kv:
            raise ValueError("fp16 and fp32_kv both name the KV pages' dtype: choose one")
        schema.OpAttributes(policy=self.policy, sink_pages=self.sink_pages, recent_pages=self.recent_pages,
                            sub_page_size=self.resolved_sub_page_size(), candidate_share=self.candidate_share,
                            group_reduce=self.resolved_group_reduce)
        if self.sub_page_size and self.resolved_page_size() % self.sub_page_size:
            raise ValueError(f"sub_page_size must divide the page size {self.resolved_page_size()}, "
                             f"got {self.sub_page_size}")
        if self.cold_format is not None and self.cold_format not in schema.COLD_FORMATS:
            raise ValueError(f"cold_format must be one of {schema.COLD_FORMATS}, got {self.cold_format!r}")
        if isinstance(self.int8_layers, str):
            if self.int8_layers not in INT8_LAYER_CHOICES:
                raise ValueError(f"int8_layers must be one of {INT8_LAYER_CHOICES} or layer indices, "
                                 f"got {self.int8_layers!r}")
        elif self.int8_layers is not None:
            object.__setattr__(self, "int8_layers", check_int8_layers(self.int8_layers, "int4"))
        if self.int8_layers not in (None, "none", ()) and not self.has_cold_tier:
            raise ValueError("int8 layers need a cold tier (--cold-pages int4 or --calibration)")
        if self.int8_layers not in (None, "none", ()) and self.resolved_cold_format != "int4":
            raise ValueError(f"int8 layers apply to int4 cold pages only (this export's cold format is "
                             f"{self.resolved_cold_format})")
        if self.calibration is not None and (not isinstance(self.calibration, str) or not self.calibration):
            raise ValueError(f"calibration must be a path to a calibration.json, got {self.calibration!r}")

    @property
    def resolved_group_reduce(self) -> str:
        return self.group_reduce or DEFAULT_GROUP_REDUCE

    @property
    def decode_budget(self) -> DecodeBudget:
        return DecodeBudget(self.token_budget, self.budget_share)

    @property
    def has_cold_tier(self) -> bool:
        return self.cold_pages or self.calibration is not None

    @property
    def resolved_cold_format(self) -> str:
        """``cold_format``, or the backend's default (int4 for ort, int8 for trt)."""
        return self.cold_format or ("int8" if self.backend == "trt" else "int4")

    def runs_int8_pass(self) -> bool:
        """Whether the export picks the INT8 layers by the sensitivity pass (``auto_int8.py``):
        ``int8_layers`` "auto", or None for an int4 cold tier without a calibration artifact."""
        if not self.has_cold_tier or self.resolved_cold_format != "int4":
            return False
        return self.int8_layers == "auto" or (self.int8_layers is None and self.calibration is None)

    def resolved_int8_layers(self, num_layers: int, calibrated: Sequence[int] | None = None,
                             measured: tuple[Sequence[int], str] | None = None) -> tuple[tuple, str]:
        """``(layers, where they came from)`` for a ``num_layers`` model: () for int8 packages;
        ``calibrated`` is the artifact's list (None when it names none), ``measured`` the
        sensitivity pass's ``(layers, description)`` when :meth:`runs_int8_pass`. ValueError for an
        index past the model's layers or an auto export without ``measured``."""
        if not self.has_cold_tier or self.resolved_cold_format != "int4":
            return (), "int8 package"
        if self.runs_int8_pass():
            if measured is None:
                raise ValueError("int8 layers 'auto' need the sensitivity pass's result (export_model runs it)")
            layers, where = tuple(measured[0]), measured[1]
        elif self.int8_layers is None and calibrated is not None:
            layers, where = tuple(calibrated), "from calibration (layer sensitivity)"
        elif self.int8_layers == "dense":
            layers = self.dense_layer_set(num_layers)
            where = f"the dense layers ({', '.join(map(str, layers)) or 'none'})"
        elif self.int8_layers is None:  # a calibration artifact that names none (an INT8 one)
            layers, where = (), "the calibration names none"
        elif self.int8_layers == "none":
            layers, where = (), "--int8-layers none"
        else:
            layers, where = self.int8_layers, "from --int8-layers"
        bad = [i for i in layers if i >= num_layers]
        if bad:
            raise ValueError(f"int8 layers {bad} out of range: the model has {num_layers} layers (0..{num_layers - 1})")
        return tuple(sorted(layers)), where

    def dense_layer_set(self, num_layers: int) -> tuple[int, ...]:
        """The dense layers of a ``num_layers`` model (ValueError for an index past its layers)."""
        return dense_layer_indices(self.dense_layers, num_layers)

    def tolerance(self) -> float:
        """FP16 pages round K/V to 11 significant bits; SmolLM2's logits then move by
        ~1.7e-2 (measured), so fp16 packages are held to 5e-2, fp32 ones to 1e-4."""
        if self.validate_tolerance is not None:
            return self.validate_tolerance
        return 5e-2 if self.fp16 else 1e-4

    def _default_two_level(self) -> bool:
        return self.sub_page_size is None and self.policy in schema.TWO_LEVEL_POLICIES

    def resolved_sub_page_size(self) -> int:
        """The sub-page size the sparse layers use: ``sub_page_size``, or by default
        ``DEFAULT_SUB_PAGE_SIZE`` for a package of a two-level policy when it divides
        the page size (and is smaller); 0 (single level) otherwise."""
        if self.sub_page_size is not None:
            return self.sub_page_size
        ps = self.resolved_page_size()
        ok = self._default_two_level() and ps % DEFAULT_SUB_PAGE_SIZE == 0 and ps > DEFAULT_SUB_PAGE_SIZE
        return DEFAULT_SUB_PAGE_SIZE if ok else 0

    def resolved_page_size(self) -> int:
        """``auto`` with the default two-level selection: ``DEFAULT_PAGE_SIZE``, the page
        size measured with it. ``auto`` single level: the power of two nearest
        sqrt(max_context / 16), kept in the band 8-16 up to 4K tokens, 16-32 up to
        16K, 32-64 beyond. Scoring reads one min/max pair per page (cost ~ context /
        page) while coarse pages waste budget on unneeded tokens (cost ~ page); the
        square root balances the two for a budget of ~1/16 of the context."""
        if self.page_size != "auto":
            return int(self.page_size)
        if self._default_two_level() or (self.sub_page_size and self.policy in schema.TWO_LEVEL_POLICIES):
            return DEFAULT_PAGE_SIZE
        ctx = self.max_context or FALLBACK_MAX_CONTEXT
        lo, hi = (8, 16) if ctx <= 4096 else (16, 32) if ctx <= 16384 else (32, 64)
        ideal = 2 ** round(math.log2(math.sqrt(ctx / 16)))
        return min(hi, max(lo, ideal))

    def layer_attributes(self, layer: int, scale: float) -> schema.OpAttributes:
        """Dense layers, and a sub-page size equal to the page size, are single-level (no fine bounds)."""
        policy = "dense" if layer in dense_layer_indices(self.dense_layers) else self.policy
        sp = self.resolved_sub_page_size()
        two_level = policy != "dense" and sp not in (0, self.resolved_page_size())
        return schema.OpAttributes(scale=scale, policy=policy, sink_pages=self.sink_pages,
                                   recent_pages=self.recent_pages, candidate_share=self.candidate_share,
                                   sub_page_size=sp if two_level else 0,
                                   group_reduce=self.resolved_group_reduce if policy != "dense" else
                                   schema.attribute("group_reduce").default)
