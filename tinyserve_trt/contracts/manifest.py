"""The package manifest, ``tinyserve.json``: typed, versioned, validated - the one place that knows it.

``tinyserve-export`` builds a :class:`Manifest` and :meth:`Manifest.save`\\ s it
into the package; the runtime (``runtime.model_package.ModelPackage``) and the
Polygraphy data loader :meth:`Manifest.load` it. Every check raises
:class:`PackageError` with one line naming the file and the field. Unknown
top-level keys (e.g. ``model_name``) are kept in ``extra`` and written back.

Package files (all in one directory)::

    tinyserve.json        this manifest
    model.onnx            the rewritten model (graph); weights in model.onnx.data
    model.onnx.data       every weight, once
    model.ort.onnx        ORT's optimized graph (optional), weights read from model.onnx.data
    model.plan            a TensorRT engine (backend "trt")
    calibration.json/npz  the calibration artifact (a cold-tier package exported with one)
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from tinyserve_trt.contracts import manifest_fields as checks
from tinyserve_trt.contracts.budget import DecodeBudget
from tinyserve_trt.contracts.cold_tier import HotnessConfig, TierConfig
from tinyserve_trt.contracts.ort_plan import OrtGraphPlan
from tinyserve_trt.contracts.package_paths import PackageError, check_name, resolve_inside
from tinyserve_trt.ops.cold_codec import INT4_FORMAT_VERSION

MANIFEST_FILE = "tinyserve.json"
MODEL_FILE = "model.onnx"
MODEL_DATA_FILE = "model.onnx.data"
ORT_GRAPH_FILE = "model.ort.onnx"
ENGINE_FILE = "model.plan"
CALIBRATION_FILE = "calibration.json"
FORMAT = "tinyserve-package"
FORMAT_VERSION = 1
DTYPES = ("float32", "float16")

INPUT_ROLES = ("input_ids", "page_table", "past_lens", "token_budget")
LAYER_ROLES = ("key_cache", "value_cache", "key_min", "key_max", "new_key", "new_value")
COLD_ROLES = ("key_cache_int8", "value_cache_int8", "key_scale", "value_scale")  # ops.schema.COLD_INPUTS
SUB_ROLE = "key_sub_bounds"  # ops.schema.TWO_LEVEL_INPUTS: per sparse layer of a two-level package
INT_FIELDS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "page_size", "token_budget")


@dataclass(frozen=True)
class PackageIO:
    """Names of the rewritten model's inputs and outputs, by role.

    inputs:  role -> input name (``input_ids``, ``position_ids``, ``page_table``, ``past_lens``,
             ``token_budget``, ``logits_index`` when present).
    outputs: role -> output name (``logits``).
    layers:  per layer, role -> name (``LAYER_ROLES``, ``selected_pages``, with a cold tier
             also ``COLD_ROLES``).
    """

    inputs: dict
    outputs: dict
    layers: list

    def __post_init__(self):
        if not isinstance(self.inputs, dict) or not isinstance(self.layers, list):
            raise PackageError("'io' must hold 'inputs' and 'layers'")
        missing = [r for r in INPUT_ROLES if r not in self.inputs]
        if missing:
            raise PackageError(f"io.inputs lacks {missing}")
        for i, layer in enumerate(self.layers):
            lacking = [r for r in LAYER_ROLES if not isinstance(layer, dict) or r not in layer]
            if lacking:
                raise PackageError(f"io.layers[{i}] lacks {lacking}")
        if not isinstance(self.outputs, dict) or "logits" not in self.outputs:
            raise PackageError("io.outputs lacks 'logits'")
        checks.check_names("io.inputs", self.inputs)
        checks.check_names("io.outputs", self.outputs)
        for i, layer in enumerate(self.layers):
            checks.check_layer_io(i, layer)


def _old_int4(version) -> str:
    return (f"cold_tier: INT4 cold-page format version {version!r}, this tinyserve reads {INT4_FORMAT_VERSION} "
            "(keys on the sub-page bounds, asymmetric V: ops/cold_codec.py): re-export the package with --cold-pages int4")


@dataclass(frozen=True)
class ColdTier:
    """The cold tier the model was exported with (``tinyserve-export --calibration``
    or ``--cold-pages int8|int4``): ``cold_format`` (the op overload's and the cold inputs'
    types; a manifest without it is int8; ``cold_format_version``: int4's, a package written
    with another version - 1: symmetric keys, 2: symmetric V and keys on the page bounds
    only - is refused, its bytes read otherwise), scale granularities and ``group_size``, the
    hot/cold policy defaults (``contracts.cold_tier.TierConfig`` / ``HotnessConfig``
    fields), and ``calibration``: where they came from (``file`` in the package, model,
    ...), None for defaults. ``int8_layers`` (int4 only; absent: none): sorted layers whose
    cold pages, cold inputs and op overload are INT8 (``TierConfig.int8_layers``, issue #17);
    :class:`Manifest` checks them against ``num_layers``."""

    k_granularity: str
    v_granularity: str
    hot_fraction: float
    sink_pages: int
    recent_pages: int
    decay: float
    inputs: list = field(default_factory=lambda: list(COLD_ROLES))
    calibration: dict | None = None
    cold_format: str = "int8"
    group_size: int = 0
    cold_format_version: int | None = None  # int4: ops.cold_codec.INT4_FORMAT_VERSION (set when None)
    int8_layers: list = field(default_factory=list)
    int8_layers_source: str | None = None  # how the exporter chose them (dense layers, calibration, auto, ...)
    # the export's own sensitivity pass (int8 layers "auto"): mean KL(all hot || only that layer
    # INT4) per layer, on the built-in text; None when the layers came from elsewhere
    int8_layers_kl: list | None = None

    def __post_init__(self):
        if self.calibration is not None and (not isinstance(self.calibration, dict) or "file" not in self.calibration):
            raise PackageError(f"cold_tier.calibration must be null or an object with 'file', got {self.calibration!r}")
        if self.calibration is not None:
            check_name(self.calibration["file"], "cold_tier.calibration.file")
        checks.check_cold_tier_types(self)
        if self.cold_format == "int4":
            if self.cold_format_version is None:  # built in code: the current format
                object.__setattr__(self, "cold_format_version", INT4_FORMAT_VERSION)
            elif self.cold_format_version != INT4_FORMAT_VERSION:
                raise PackageError(_old_int4(self.cold_format_version))
        if self.int8_layers_kl is not None and (
                not isinstance(self.int8_layers_kl, list)
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0
                           for x in self.int8_layers_kl)):
            raise PackageError(f"cold_tier: int8_layers_kl must be a list of numbers >= 0, got {self.int8_layers_kl!r}")
        try:
            tiers = TierConfig(k_granularity=self.k_granularity, v_granularity=self.v_granularity,
                               cold_format=self.cold_format, group_size=self.group_size, int8_layers=self.int8_layers)
            object.__setattr__(self, "int8_layers", list(tiers.int8_layers))
            HotnessConfig(decay=self.decay, sink_pages=self.sink_pages, recent_pages=self.recent_pages,
                          hot_fraction=self.hot_fraction)
        except (ValueError, TypeError) as e:  # TypeError: a value of the wrong type compared
            raise PackageError(f"cold_tier: {e}") from None


@dataclass(frozen=True)
class OrtOptimized:
    """ONNX Runtime's optimized graph (``export.ort_graph``): valid for this ORT version and
    the CPU EP only. ``weights``: the file its shared initializers point into;
    ``shared_bytes`` / ``own_bytes``: weight bytes read from there / from its own data file.
    ``plan``: how it was made - opset, contrib fusions, the native decode node - and why
    (``contracts.ort_plan.OrtGraphPlan``: one typed record; ``opset``, ``native`` and the notes
    below read it)."""

    file: str
    onnxruntime: str
    level: str = "extended"
    weights: str | None = None
    shared_bytes: int = 0
    own_bytes: int = 0
    plan: OrtGraphPlan = field(default_factory=lambda: OrtGraphPlan(None))

    def __post_init__(self):
        check_name(self.file, "ort_optimized.file")
        if self.weights is not None:
            check_name(self.weights, "ort_optimized.weights")
        checks.check_ort_optimized(self)
        if not isinstance(self.plan, OrtGraphPlan):
            raise PackageError(f"ort_optimized.plan must be an OrtGraphPlan, got {self.plan!r}")

    @property
    def opset(self) -> int | None:
        """ai.onnx opset of the graph (None: a package from before it was recorded)."""
        return self.plan.opset

    @property
    def opset_note(self) -> str | None:
        """Why the graph kept an older opset (None when raised or already new enough)."""
        return self.plan.opset_why

    @property
    def native(self) -> str | None:
        """The domain of the native CPU decode node the graph calls (``export.native_decode``; the
        runtime registers ``tinyserve_trt.cpu``'s library, or loads the portable model without it)."""
        return self.plan.native_domain

    @property
    def native_note(self) -> str | None:
        """When ``native`` is None, why the export left the op's function to decode
        (``--no-native-decode``, no compiler, a policy it lacks, out of tolerance)."""
        return self.plan.native_why

    @classmethod
    def from_dict(cls, opt, validation: dict | None = None) -> OrtOptimized:
        """``ort_optimized`` of the JSON; a package from before ``plan`` gets it from the old fields
        (``OrtGraphPlan.from_legacy``, which also reads the manifest's ``validation``)."""
        if not isinstance(opt, dict) or "file" not in opt or "onnxruntime" not in opt:
            raise PackageError("ort_optimized must hold 'file' and 'onnxruntime'")
        plan = OrtGraphPlan.from_dict(opt["plan"]) if "plan" in opt else OrtGraphPlan.from_legacy(opt, validation)
        names = {f.name for f in fields(cls)} - {"plan"}
        return cls(**{k: v for k, v in opt.items() if k in names}, plan=plan)


@dataclass(frozen=True)
class Manifest:
    """What a package holds and how to drive it. Dims are per model; ``token_budget`` and
    ``budget_share`` are the runtime's default decode budget (``decode_budget``; 0 = dense);
    ``engine`` holds the TensorRT engine's file and the limits of its profile
    (``contracts.engine_profiles``)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    page_size: int
    token_budget: int
    io: PackageIO
    dtype: str = "float32"
    max_context: int = 8192
    dense_layers: int = 0
    policy: str = "query_aware"
    sink_pages: int = 1
    recent_pages: int = 1
    backend: str = "ort"
    cold_tier: ColdTier | None = None
    sub_page_size: int = 0  # two-level selection (issue #15): the runtime pools keep key_sub_bounds
    candidate_share: float | None = None
    budget_share: float = 0.0  # the default budget's share of the context above token_budget (contracts.budget)
    group_reduce: str = "max"  # how the sparse layers' GQA groups select (the op's attribute; "head": per query head)
    ort_optimized: OrtOptimized | None = None
    engine: dict | None = None
    bos_token_id: int | list | None = None
    eos_token_id: int | list | None = None
    op: dict | None = None
    source: dict | None = None
    source_io: dict | None = None
    validation: dict | None = None
    tool_version: str | None = None
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in (*INT_FIELDS, "max_context"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "token_budget" else 1):
                raise PackageError(f"field {name!r} must be a positive int, got {value!r}")
        if not isinstance(self.format_version, int) or not 1 <= self.format_version <= FORMAT_VERSION:
            raise PackageError(f"format_version {self.format_version!r} is not one this tinyserve reads "
                               f"(1..{FORMAT_VERSION}); upgrade tinyserve-trt")
        checks.check_scalars(self)
        if len(self.io.layers) != self.num_layers:
            raise PackageError(f"io.layers has {len(self.io.layers)} entries for num_layers={self.num_layers}")
        if self.cold_tier is not None:
            for i, layer in enumerate(self.io.layers):
                lacking = [r for r in COLD_ROLES if r not in layer]
                if lacking:
                    raise PackageError(f"io.layers[{i}] lacks the cold-tier inputs {lacking}")
            bad = [i for i in self.cold_tier.int8_layers if i >= self.num_layers]
            if bad:
                raise PackageError(f"cold_tier: int8_layers {bad} out of range for num_layers={self.num_layers}")
            kl = self.cold_tier.int8_layers_kl
            if kl is not None and len(kl) != self.num_layers:
                raise PackageError(f"cold_tier: int8_layers_kl has {len(kl)} entries for num_layers={self.num_layers}")
        if self.dtype not in DTYPES:
            raise PackageError(f"dtype must be float32 or float16, got {self.dtype!r}")
        self._check_two_level()
        self.named_files()  # each a relative name without '..'

    @property
    def decode_budget(self) -> DecodeBudget:
        """The default decode budget: ``token_budget`` tokens at least, ``budget_share`` of the context above."""
        return DecodeBudget(self.token_budget, self.budget_share)

    def named_files(self) -> dict[str, str]:
        """field -> the file name it gives, for every file the manifest names (checked relative
        names; :meth:`load` also checks that each resolves inside the package)."""
        files = {}
        if self.ort_optimized is not None:
            files["ort_optimized.file"] = self.ort_optimized.file
            if self.ort_optimized.weights is not None:
                files["ort_optimized.weights"] = self.ort_optimized.weights
        if self.engine is not None:
            files["engine.file"] = self.engine["file"]
        if self.cold_tier is not None and self.cold_tier.calibration is not None:
            files["cold_tier.calibration.file"] = self.cold_tier.calibration["file"]
        return {field: check_name(name, field) for field, name in files.items()}

    def _check_two_level(self) -> None:
        """``sub_page_size`` (absent: 0) properly divides the page size, and exactly the layers
        that select (policy not dense) take ``key_sub_bounds`` when it is set; none when 0."""
        sp, ps = self.sub_page_size, self.page_size
        if not isinstance(sp, int) or isinstance(sp, bool) or sp < 0 or (sp and (ps % sp or sp == ps)):
            raise PackageError(f"sub_page_size must be 0 or a proper divisor of page_size {ps}, got {sp!r}")
        for i, layer in enumerate(self.io.layers):
            if (SUB_ROLE in layer) != bool(sp and layer.get("policy") != "dense"):
                raise PackageError(f"io.layers[{i}] ({layer.get('policy')}) "
                                   + (f"lacks {SUB_ROLE!r} for sub_page_size {sp}" if sp else
                                      f"has {SUB_ROLE!r} but sub_page_size is 0"))

    # ---- JSON ---------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        """Validate ``data`` (the parsed JSON); PackageError naming the first problem."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PackageError(f"format is not {FORMAT!r}")
        data = dict(data)
        data.pop("format")
        io = data.pop("io", None)
        if not isinstance(io, dict):
            raise PackageError("'io' must hold 'inputs' and 'layers'")
        known = {f.name for f in fields(cls)} - {"io", "extra"}
        kw = {k: data.pop(k) for k in list(data) if k in known}
        for name in INT_FIELDS:
            kw.setdefault(name, None)  # reported by __post_init__ as "field ... got None"
        cold = kw.get("cold_tier")
        if cold is not None:
            tier_fields = [f.name for f in fields(ColdTier) if f.default is MISSING and f.default_factory is MISSING]
            if not isinstance(cold, dict) or any(k not in cold for k in tier_fields):
                raise PackageError(f"cold_tier must hold {tier_fields}")
            if cold.get("cold_format") == "int4" and cold.get("cold_format_version") is None:
                raise PackageError(_old_int4(1))  # written before the version: symmetric INT4 keys
            kw["cold_tier"] = ColdTier(**{k: v for k, v in cold.items() if k in {f.name for f in fields(ColdTier)}})
        if kw.get("ort_optimized") is not None:
            kw["ort_optimized"] = OrtOptimized.from_dict(kw["ort_optimized"], kw.get("validation"))
        kw = {k: v for k, v in kw.items() if v is not None or k in INT_FIELDS}
        return cls(io=PackageIO(io.get("inputs"), io.get("outputs", {}), io.get("layers")), extra=data, **kw)

    def to_dict(self) -> dict:
        """The JSON object (``format`` first, optional sections only when set)."""
        out = {"format": FORMAT}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "extra" or value is None:
                continue
            out[f.name] = asdict(value) if f.name in ("io", "cold_tier", "ort_optimized") else value
        out.update(self.extra)
        return out

    # ---- files --------------------------------------------------------------
    @classmethod
    def load(cls, package: str | Path) -> Manifest:
        """Read and check ``package/tinyserve.json`` (and that ``model.onnx`` is there)."""
        package = Path(package)
        if not package.is_dir():
            raise PackageError(f"{package}: not a directory (expected a package written by tinyserve-export)")
        path = package / MANIFEST_FILE
        if not path.is_file():
            raise PackageError(f"{package}: no {MANIFEST_FILE} (not a tinyserve package; run tinyserve-export first)")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PackageError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PackageError(f"{path}: format is not {FORMAT!r}")
        try:
            model = resolve_inside(package, MODEL_FILE, MODEL_FILE)
        except PackageError as e:
            raise PackageError(f"{package}: {e}") from None
        if not model.is_file():
            raise PackageError(f"{package}: {MODEL_FILE} is missing")
        try:
            manifest = cls.from_dict(data)
            for field_name, name in manifest.named_files().items():
                resolve_inside(package, name, field_name)
            return manifest
        except PackageError as e:
            raise PackageError(f"{path}: {e}") from None

    def save(self, package: str | Path) -> Path:
        """Write ``package/tinyserve.json``; returns its path."""
        path = Path(package) / MANIFEST_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path
