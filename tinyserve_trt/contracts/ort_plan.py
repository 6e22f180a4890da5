"""OrtGraphPlan: how ``model.ort.onnx`` is made from ``model.onnx`` - one typed record of the choice.

The exporter chooses three things for the ONNX Runtime graph (``export/ort_validation.py`` when it
validates, ``export/pipeline.py`` otherwise) and ``export/ort_graph.save_optimized_graph`` builds it
from the plan: the ai.onnx opset it is raised to (``export/ort_opset.py``), whether ORT's contrib
fusions are applied (``skip_norm.py``, ``rotary.py``) and whether its decode steps call the native
CPU node (``native_decode.py``: its domain and node version). Each ``*_why`` says why that choice
is not the preferred one - raised opset, fusions on, native decode - and is None when it is.
The manifest holds it as ``ort_optimized.plan``; the runtime (``runtime/backends/ort.py``, the
kernel report) reads it. Packages from before the plan are read with :meth:`OrtGraphPlan.from_legacy`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from tinyserve_trt.contracts.package_paths import PackageError


def _one_line(name: str, value) -> None:
    if value is not None and (not isinstance(value, str) or not value or "\n" in value):
        raise PackageError(f"ort_optimized.plan.{name} must be a one-line string or null, got {value!r}")


def _positive_int(name: str, value, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PackageError(f"ort_optimized.plan.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class OrtGraphPlan:
    """opset:           ai.onnx opset of ``model.ort.onnx`` (None: a package from before it was recorded).
    contrib_fusions: ORT contrib ops (SkipSimplifiedLayerNormalization, RotaryEmbedding) fused in.
    native_domain:   the custom-op domain of the native decode node the graph calls (every session
                     must register its library), None: decode steps run the op's ONNX function.
    native_version:  that domain's node version (``cpu.node.VERSION`` at export; None: not recorded).
    opset_why / fusions_why / native_why: why the opset was not raised, the fusions were dropped,
                     the native node is not called (one line each; None: not so)."""

    opset: int | None
    contrib_fusions: bool = True
    native_domain: str | None = None
    native_version: int | None = None
    opset_why: str | None = None
    fusions_why: str | None = None
    native_why: str | None = None

    def __post_init__(self):
        _positive_int("opset", self.opset, optional=True)
        if not isinstance(self.contrib_fusions, bool):
            raise PackageError(f"ort_optimized.plan.contrib_fusions must be a bool, got {self.contrib_fusions!r}")
        _one_line("native_domain", self.native_domain)
        _positive_int("native_version", self.native_version, optional=True)
        if self.native_version is not None and self.native_domain is None:
            raise PackageError("ort_optimized.plan.native_version without native_domain")
        for name in ("opset_why", "fusions_why", "native_why"):
            _one_line(name, getattr(self, name))
        if self.native_domain is not None and self.native_why is not None:
            raise PackageError("ort_optimized.plan: native_why is for a graph that does not call the native node")
        if self.contrib_fusions and self.fusions_why is not None:
            raise PackageError("ort_optimized.plan: fusions_why is for a graph without the contrib fusions")

    @property
    def native(self) -> bool:
        return self.native_domain is not None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data) -> OrtGraphPlan:
        """The plan of ``ort_optimized.plan``; PackageError on a missing, unknown or bad field."""
        names = [f.name for f in fields(cls)]
        if not isinstance(data, dict) or "opset" not in data:
            raise PackageError("ort_optimized.plan must be an object with 'opset'")
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise PackageError(f"ort_optimized.plan has unknown fields {unknown}")
        return cls(**data)

    @classmethod
    def from_legacy(cls, opt: dict, validation: dict | None) -> OrtGraphPlan:
        """The plan of a package written before it (``ort_optimized.opset`` / ``opset_note`` /
        ``native`` / ``native_note``, the validation's untyped ``ort_contrib_ops`` and
        ``ort_native_check``); the native node's version is not known (the runtime reads the graph's
        opset import)."""
        validation = validation if isinstance(validation, dict) else {}
        if opt.get("opset") is not None:  # named as the old manifest spells it
            try:
                _positive_int("opset", opt["opset"], optional=True)
            except PackageError:
                raise PackageError(f"ort_optimized.opset must be a positive int, got {opt['opset']!r}") from None
        for name in ("native", "native_note", "opset_note"):
            if opt.get(name) is not None and not isinstance(opt[name], str):
                raise PackageError(f"ort_optimized.{name} must be a string or null, got {opt[name]!r}")
        contrib = validation.get("ort_contrib_ops", True)
        native = opt.get("native")
        why = None
        if native is None:
            check = validation.get("ort_native_check")
            why = opt.get("native_note") or (f"the export did not use the native kernel ({check})" if check else
                                             "the package's ORT graph does not call the native kernel "
                                             "(exported without it)")
        return cls(opset=opt.get("opset"), contrib_fusions=contrib if isinstance(contrib, bool) else True,
                   native_domain=native, opset_why=opt.get("opset_note"),
                   fusions_why=None if contrib is not False else "ORT contrib fusions failed validation",
                   native_why=" ".join(str(why).split()) if why else None)
