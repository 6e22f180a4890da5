"""KernelReport: what an engine runs - which graph, which decode kernel, which cold format, and why.

One record per engine, made by its backend when the session opens (``Backend.kernel_report``)
and completed by the engine (the cold format it serves). ``Engine`` logs :meth:`KernelReport.line`
once at start (WARNING when the decode kernel is a fallback, INFO otherwise) and puts
:meth:`KernelReport.stats` into ``Engine.stats()`` (so ``LLM.stats()``, ``tinyserve generate --json``
and the server's ``/metrics`` carry it). With ``EngineConfig.require_native`` a decode kernel that
is not native (:data:`NATIVE_KERNELS`) is :class:`NativeRequired` - one line saying why.

Decode kernels (:data:`DECODE_KERNELS`):

  native_cpu       the op as C++ nodes (``tinyserve.cpu``): decode steps, and prefill chunks in node-version-3
                   graphs (``QueryAwareSparseAttentionLayer``: with the layer's head split and rotary)
  onnx_function    the op's ONNX function (model-local), inlined by ONNX Runtime - ~80-110 nodes a layer
  cuda_ep          the same function, inlined, on ONNX Runtime's CUDA EP
  tensorrt_plugin  the CUDA kernels as the TensorRT plugin (TensorRT backend, or ORT's TensorRT EP)

Pure data: no onnxruntime import.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

DECODE_KERNELS = {
    "native_cpu": "the native CPU node (tinyserve.cpu)",
    "onnx_function": "the op's ONNX function",
    "cuda_ep": "the op's ONNX function on the CUDA EP",
    "tensorrt_plugin": "the TensorRT plugin (tinyserve::QueryAwareSparseAttention)",
}
NATIVE_KERNELS = ("native_cpu", "tensorrt_plugin")
REPORT_KEYS = ("kernel_graph", "kernel_decode", "kernel_cold_format", "kernel_provider", "kernel_library",
               "kernel_fallback", "kernel_reason")


class NativeRequired(RuntimeError):
    """``require_native`` and the decode kernel is not native; the message is one line saying why."""


@dataclass(frozen=True)
class KernelReport:
    """What one engine runs.

    backend:       backend registry name (``ort``, ``trt``).
    provider:      where it runs: ``cpu``, ``cuda``, ``tensorrt`` (ORT EPs) or ``tensorrt`` (engine).
    graph:         the file loaded, relative to the package (``model.ort.onnx``, ``model.onnx``, ``model.plan``).
    decode_kernel: a :data:`DECODE_KERNELS` key.
    cold_format:   the cold pages' format as served (``int8``, ``int4 (int8 layers 3)``); None: every
                   page hot (no cold tier, or ``kv_tiers=False``).
    library:       the native library or plugin loaded (a path), None when none is.
    nodes:         the native node types the graph runs (``domain::type``; the log line names them), () when
                   not read.
    fallback:      True when the package asked for a faster kernel than the one that runs here.
    reason:        why this kernel and not a native one (None when native): e.g. ``no C++ compiler``,
                   ``package exported with --no-native-decode``.
    """

    backend: str
    provider: str
    graph: str
    decode_kernel: str
    cold_format: str | None = None
    library: str | None = None
    fallback: bool = False
    reason: str | None = None
    nodes: tuple[str, ...] = ()

    def __post_init__(self):
        if self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel must be one of {sorted(DECODE_KERNELS)}, got {self.decode_kernel!r}")
        for name in ("backend", "provider", "graph"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        for name in ("cold_format", "library", "reason"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string or None, got {value!r}")
        if self.reason is not None:  # one line, as it is logged and exported
            object.__setattr__(self, "reason", " ".join(self.reason.split()))
        if not isinstance(self.fallback, bool):
            raise ValueError(f"fallback must be a bool, got {self.fallback!r}")
        if not isinstance(self.nodes, tuple) or not all(isinstance(n, str) and n for n in self.nodes):
            raise ValueError(f"nodes must be a tuple of node type names, got {self.nodes!r}")
        if self.fallback and not self.reason:
            raise ValueError("a fallback needs a reason")

    @property
    def native(self) -> bool:
        return self.decode_kernel in NATIVE_KERNELS

    def with_cold_format(self, cold_format: str | None) -> KernelReport:
        return replace(self, cold_format=cold_format)

    def line(self) -> str:
        """The one log line: ``kernel report: graph model.onnx (cpu), decode: the op's ONNX function,
        cold pages: int8; fallback: <why>``."""
        text = (f"kernel report: graph {self.graph} ({self.backend} {self.provider}), decode: "
                f"{DECODE_KERNELS[self.decode_kernel]}")
        if self.nodes:
            text += " as " + ", ".join(self.nodes)
        if self.library:
            text += f" from {self.library}"
        text += f", cold pages: {self.cold_format or 'none (all hot)'}"
        if self.reason:
            text += f"; {'fallback' if self.fallback else 'not native'}: {self.reason}"
        return text

    def stats(self) -> dict:
        """The report as ``Engine.stats()`` entries (:data:`REPORT_KEYS`)."""
        return {"kernel_graph": self.graph, "kernel_decode": self.decode_kernel,
                "kernel_cold_format": self.cold_format, "kernel_provider": self.provider,
                "kernel_library": self.library, "kernel_fallback": self.fallback, "kernel_reason": self.reason}

    def check_native(self) -> None:
        """NativeRequired (one line) unless the decode kernel is native."""
        if not self.native:
            raise NativeRequired(f"a native decode kernel is required (require_native) but this engine would decode "
                                 f"on {DECODE_KERNELS[self.decode_kernel]} ({self.graph}, {self.provider}): "
                                 f"{self.reason or 'no native kernel for this provider'}")


def export_note(spec) -> str | None:
    """Why the package's ORT graph decodes on the op's function (None: it calls the native kernel),
    as the exporter recorded it (``ort_optimized.plan.native_why``; packages from before the plan:
    ``contracts.ort_plan.OrtGraphPlan.from_legacy`` reads the old note or ``ort_native_check``)."""
    opt = spec.ort_optimized
    if opt is None:
        return "the package has no ONNX Runtime graph (model.ort.onnx)"
    if opt.native:
        return None
    if getattr(opt, "native_note", None):
        return opt.native_note
    check = (spec.validation or {}).get("ort_native_check")
    if check:
        return f"the export did not use the native kernel ({check})"
    return "the package's ORT graph does not call the native kernel (exported without it)"


def cold_format_of(package, tiers_on: bool) -> str | None:
    """The cold format the engine serves: the package's (``describe_format``) when its tiers are on."""
    if not tiers_on or not package.cold_tier:
        return None
    from tinyserve_trt.contracts.cold_tier import describe_format

    tier = package.cold_tier
    return describe_format(tier.get("cold_format", "int8"), tier.get("int8_layers", ()))
