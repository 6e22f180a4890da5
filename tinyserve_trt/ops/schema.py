"""The single definition of ``tinyserve::QueryAwareSparseAttention`` (version 1).

Every consumer reads this module: the ONNX node builder (``ops/node.py``), the
ONNX function body (``ops/function.py``), the numpy reference
(``ops/reference.py``), the exporter, the CUDA launcher and the TensorRT
plugin's fields (``plugins/``, checked by ``tests/ops/test_schema.py``).
User documentation: ``docs/op.md``.

Named dims used throughout:
  B  batch (sequences in the call)        S   new tokens per sequence
  H  query heads    Hkv  KV heads (H % Hkv == 0, G = H / Hkv)
  D  head dim       P    page-pool size (hot pages; + cold pages, see below)
  ps page size      NP   page-table width (max pages per sequence, >= 1)
  sp sub-page size  r    sub-pages per page (ps / sp; two-level selection only)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import policies as _policies

DOMAIN = "tinyserve"
OP_TYPE = "QueryAwareSparseAttention"
VERSION = 1
OPSET = 21  # ai.onnx opset the function body is written against
PLUGIN_NAMESPACE = "tinyserve"
PLUGIN_VERSION = "1"

FLOAT_TYPES = ("float32", "float16")


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of the op."""

    name: str
    shape: tuple[str, ...]
    dtype: str  # "T" (the float type of query), or a concrete numpy dtype name
    doc: str
    optional: bool = False


@dataclass(frozen=True)
class AttributeSpec:
    """One attribute: ONNX type, default, allowed values or range."""

    name: str
    type: str  # "int" | "float" | "string"
    default: object
    doc: str
    choices: tuple = ()
    min: float | None = None
    max: float | None = None

    def validate(self, value):
        """Return ``value`` if allowed, else raise ValueError naming the attribute."""
        if self.type == "int" and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"attribute {self.name!r} must be an int, got {value!r}")
        if self.type == "float" and not isinstance(value, (int, float)):
            raise ValueError(f"attribute {self.name!r} must be a float, got {value!r}")
        if self.type == "string" and not isinstance(value, str):
            raise ValueError(f"attribute {self.name!r} must be a string, got {value!r}")
        if self.choices and value not in self.choices:
            raise ValueError(f"attribute {self.name!r} must be one of {self.choices}, got {value!r}")
        if self.min is not None and value < self.min:
            raise ValueError(f"attribute {self.name!r} must be >= {self.min}, got {value!r}")
        if self.max is not None and value > self.max:
            raise ValueError(f"attribute {self.name!r} must be <= {self.max}, got {value!r}")
        return value


INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("query", ("B", "H", "S", "D"), "T", "Queries of the new tokens (after rotary)."),
    TensorSpec("key", ("B", "Hkv", "S", "D"), "T", "Keys of the new tokens (after rotary); not yet in the cache."),
    TensorSpec("value", ("B", "Hkv", "S", "D"), "T", "Values of the new tokens; not yet in the cache."),
    TensorSpec("key_cache", ("P", "Hkv", "ps", "D"), "T", "Hot key page pool, shared by all sequences."),
    TensorSpec("value_cache", ("P", "Hkv", "ps", "D"), "T", "Hot value page pool."),
    TensorSpec("key_min", ("Ptot", "Hkv", "D"), "T",
               "Elementwise min of the valid keys of each page (hot and cold), by page id."),
    TensorSpec("key_max", ("Ptot", "Hkv", "D"), "T", "Elementwise max of the valid keys of each page, by page id."),
    TensorSpec("page_table", ("B", "NP"), "int32",
               "Physical page ids of each sequence's logical pages; padding must be valid ids."),
    TensorSpec("past_lens", ("B",), "int32", "Tokens already cached per sequence (excludes the S new tokens)."),
    TensorSpec("token_budget", ("B",), "int32",
               "Decode token budget per sequence: keep budget // ps pages; 0 or >= context = dense."),
    TensorSpec("key_cache_int8", ("Pcold", "Hkv", "ps", "D"), "int8",
               "Cold key pages (page ids P .. P+Pcold-1), quantized; the int4 format packs two values "
               "per byte: uint8 [Pcold, Hkv, ps, D/2] (COLD_FORMATS, ops/cold_codec.py).", optional=True),
    TensorSpec("value_cache_int8", ("Pcold", "Hkv", "ps", "D"), "int8", "Cold value pages.", optional=True),
    TensorSpec("key_scale", ("Pcold", "Hkv", "ps|1", "D|1"), "float32",
               "Dequantization scale of cold keys, broadcast over the page (k = int8 * scale); int4: a float16 "
               "[Pcold, Hkv, 1, 1] placeholder (keys on the page or sub-page bounds). Scale columns: channel c "
               "reads column c // (D / C).", optional=True),
    TensorSpec("value_scale", ("Pcold", "Hkv", "ps|1", "D|1"), "float32",
               "Dequantization scale of cold values (v = int8 * scale); int4 (format 3, asymmetric): float16 "
               "[Pcold, Hkv, ps|1, 2C], columns [0, C) the scales, [C, 2C) the mins: v = q * scale + min.",
               optional=True),
    TensorSpec("key_sub_bounds", ("Ptot", "Hkv", "r", "D"), "uint8",
               "Two-level: each sub-page's key min/max per channel, 4 bits each relative to the page's "
               "key_min/key_max, rounded outward (ops/fine_bounds.py).", optional=True),
)

OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("output", ("B", "H", "S", "D"), "T", "Attention output, same layout as query."),
    TensorSpec("selected_pages", ("B", "Hkv", "NP"), "bool",
               "True where a logical page was attended (decode: the selection; prefill: every valid page).",
               optional=True),
)

# Selection policies: the registry's (ops/policies.py defines each, once). POLICY_IDS: the
# QSA_POLICY_* ids of the generated C header, only for the policies the C code knows.
POLICIES = _policies.registered()
POLICY_IDS = _policies.native_ids()
# "head": every query head of a GQA group selects alone (its own pages, its own attention);
# selected_pages marks the group's union. "max"/"sum": one selection shared by the group.
GROUP_REDUCTIONS = ("max", "sum", "head")
# Cold-page formats: the element types of COLD_INPUTS and the last dims of the pools and scales
# (int4: two values per byte, float16 scales per channel group; ops/cold_codec.py is the rule).
COLD_FORMATS = ("int8", "int4")
COLD_DTYPES = {"int8": ("int8", "int8", "float32", "float32"), "int4": ("uint8", "uint8", "float16", "float16")}

ATTRIBUTES: tuple[AttributeSpec, ...] = (
    AttributeSpec("scale", "float", 0.0, "Softmax scale; 0 means 1/sqrt(D).", min=0.0),
    AttributeSpec("policy", "string", "query_aware", "Page selection policy for decode steps.", choices=POLICIES),
    AttributeSpec("sink_pages", "int", 1, "Leading pages always kept (attention sinks).", min=0, max=1 << 16),
    AttributeSpec("recent_pages", "int", 1, "Trailing pages always kept; the last, partial page is one.",
                  min=1, max=1 << 16),
    AttributeSpec("group_reduce", "string", "max",
                  "How a GQA group's query heads' page scores combine into one selection per KV head (max, "
                  "sum), or head: each query head selects and attends its own pages (selected_pages: the union).",
                  choices=GROUP_REDUCTIONS),
    AttributeSpec("sub_page_size", "int", 0,
                  "Two-level selection: re-rank the candidate pages' sub-pages of this many tokens "
                  "(must divide ps; needs key_sub_bounds). 0 or ps: single-level.", min=0, max=1 << 16),
    AttributeSpec("candidate_share", "float", 0.5,
                  "Two-level: share of a sequence's pages kept as candidates (at least the budget's pages).",
                  min=0.0, max=1.0),
    AttributeSpec("cold_format", "string", "int8",
                  "How the cold-page inputs are stored (COLD_DTYPES; ops/cold_codec.py); read only with them. "
                  "The TensorRT plugin and the CUDA kernels take it from here, the ONNX function from its overload.",
                  choices=COLD_FORMATS),
)

# Attributes TensorRT's ONNX parser reads to import the node as our plugin.
PLUGIN_ATTRIBUTES = {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION}

# Comparison tolerances against the reference, by the dtype of query.
TOLERANCES = {"float32": {"atol": 1e-5, "rtol": 1e-5}, "float16": {"atol": 2e-3, "rtol": 2e-3}}

INPUT_NAMES = tuple(t.name for t in INPUTS)
OUTPUT_NAMES = tuple(t.name for t in OUTPUTS)
NUM_REQUIRED_INPUTS = sum(not t.optional for t in INPUTS)
COLD_INPUTS = tuple(t.name for t in INPUTS if t.name.endswith(("_int8", "_scale")))
TWO_LEVEL_INPUTS = ("key_sub_bounds",)
NUM_TIERED_INPUTS = NUM_REQUIRED_INPUTS + len(COLD_INPUTS)  # a single-level node's most inputs
# Two-level selection re-ranks sub-pages by the policy's bound of q.k: the policies with one.
TWO_LEVEL_POLICIES = _policies.two_level()


def node_input_names(cold_pages: bool = False, two_level: bool = False) -> tuple[str, ...]:
    """A node's inputs in schema order: required, then the cold tier, then the fine bounds.
    An omitted optional input that a later one follows is "" (ONNX's skipped input)."""
    names = list(INPUT_NAMES[:NUM_REQUIRED_INPUTS])
    if cold_pages or two_level:
        names += COLD_INPUTS if cold_pages else [""] * len(COLD_INPUTS)
    if two_level:
        names += TWO_LEVEL_INPUTS
    return tuple(names)


def attribute(name: str) -> AttributeSpec:
    for a in ATTRIBUTES:
        if a.name == name:
            return a
    raise KeyError(f"{OP_TYPE} has no attribute {name!r}")


@dataclass(frozen=True)
class OpAttributes:
    """Validated attribute values of one node; defaults from ``ATTRIBUTES``."""

    scale: float = field(default_factory=lambda: attribute("scale").default)
    policy: str = field(default_factory=lambda: attribute("policy").default)
    sink_pages: int = field(default_factory=lambda: attribute("sink_pages").default)
    recent_pages: int = field(default_factory=lambda: attribute("recent_pages").default)
    group_reduce: str = field(default_factory=lambda: attribute("group_reduce").default)
    sub_page_size: int = field(default_factory=lambda: attribute("sub_page_size").default)
    candidate_share: float = field(default_factory=lambda: attribute("candidate_share").default)
    cold_format: str = field(default_factory=lambda: attribute("cold_format").default)

    def __post_init__(self):
        for a in ATTRIBUTES:
            a.validate(getattr(self, a.name))
        if self.sub_page_size and self.policy not in TWO_LEVEL_POLICIES:
            raise ValueError(f"attribute 'sub_page_size' > 0 (two-level selection) needs policy in "
                             f"{TWO_LEVEL_POLICIES}, got policy {self.policy!r}")

    @property
    def two_level(self) -> bool:
        """The node takes ``key_sub_bounds`` and uses the two-level body (``sub_page_size == ps``
        selects exactly as single-level; an exporter emits 0 for it)."""
        return self.sub_page_size > 0

    def as_dict(self) -> dict:
        return {a.name: getattr(self, a.name) for a in ATTRIBUTES}

    def function_overload(self, cold_pages: bool = False, cold_format: str | None = None) -> str:
        """The ONNX function overload implementing these attributes.

        One body per (policy, page tiers): the policy changes the graph, not just
        a constant, so each gets its own body; ORT picks it by the node's
        ``overload`` field, TensorRT by op type + ``plugin_namespace``. The cold
        tier's format (``COLD_FORMATS``; default: the ``cold_format`` attribute) is the
        last part: ``query_aware_int4``.
        """
        cold_format = self.cold_format if cold_format is None else cold_format
        if cold_format not in COLD_FORMATS:
            raise ValueError(f"cold_format must be one of {COLD_FORMATS}, got {cold_format!r}")
        parts = [self.policy]
        if self.group_reduce != attribute("group_reduce").default:
            parts.append(self.group_reduce)
        if self.two_level:
            parts.append("two_level")
        if cold_pages:
            parts.append(cold_format)
        return "_".join(parts)


def overload_cold_format(overload: str) -> str | None:
    """The cold format an overload name ends with (``..._int4``), or None for a plain one."""
    last = overload.rsplit("_", 1)[-1]
    return last if last in COLD_FORMATS else None


def resolve_scale(scale: float, head_dim: int) -> float:
    return float(scale) if scale > 0 else 1.0 / float(head_dim) ** 0.5
