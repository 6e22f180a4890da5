"""The package's ORT-optimized graph, sharing the weights of ``model.onnx``.

ONNX Runtime's optimized graph (functions inlined, fusions applied) starts a
session ~3x faster than the portable model (SmolLM2: ~4 s instead of ~13 s),
but ORT saves it with its own external-data file: a second copy of every
weight (651 MB for SmolLM2). Its initializers are bit-identical to the
portable model's for the models we export (SmolLM2: all 651 MB), so
:func:`save_optimized_graph` keeps only the graph: every external initializer
whose bytes equal one in ``model.onnx.data`` points at that file's offset and
length; an initializer ORT created (folded constants) goes to a small
``model.ort.onnx.data``. One copy of the weights, the fast start kept.

Before ORT sees it, the graph is raised to ai.onnx opset 21 (``ort_opset.py``: the
op's body then decodes the sub-page bounds with blocked ``DequantizeLinear``), then
converted once to an ``onnx_ir.Model`` that the post-passes rewrite in place
(``ort_passes.py``): the op's functions are inlined, resolvable ``Shape`` dims made
constants or shared graph-input dims (``shared_shapes.py``) so ORT computes the op's
per-step page bookkeeping once per step instead of per layer, the fusions applied; it
is serialized once, its weights still references into ``model.onnx.data``.

The graph is tied to the ONNX Runtime version and the CPU EP that wrote it
(the manifest's ``ort_optimized`` records which); the runtime uses the portable
model otherwise. It does not modify ``model.onnx`` or its data file.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import replace
from pathlib import Path

from ..contracts.manifest import MODEL_DATA_FILE, MODEL_FILE, ORT_GRAPH_FILE, OrtOptimized
from ..contracts.ort_plan import OrtGraphPlan

LEVEL = "extended"  # not "all": no CPU-specific layouts in a file other machines may load
PREPARED_FILE = ".model.ort-prepared.onnx"


def prepared_graph(model, contrib_ops: bool = True, opset: int | None = None, native: bool = False):
    """What ORT optimizes into ``model.ort.onnx``: ``model`` (an ``onnx.ModelProto``, weights
    loaded or external) raised to ai.onnx ``opset`` when it is older (``ort_opset.raise_opset``,
    which raises ``OpsetRaiseError``; None: kept), with the op inlined, its shapes shared
    (``shared_shapes.py``), identical per-step nodes merged across layers (``merge_nodes.py``),
    rotary's rotate_half as one MatMul (``rotate_half.py``) and, with ``contrib_ops``, each
    residual Add + RMSNorm as ORT's SkipSimplifiedLayerNormalization (``skip_norm.py``) and each
    rotary as ORT's RotaryEmbedding (``rotary.py``).
    With ``native``, each op node the native CPU kernel implements decodes on it (``If(S == 1)``,
    ``native_decode.py``); sessions then need its library (``native_decode.session_options``).
    The exporter validates this graph against the source too, and drops the contrib ops, the
    raise or the native kernel when one alone takes a model past the tolerance (``ort_validation.py``)."""
    from .ort_passes import run_post_passes

    if opset is not None:
        from .ort_opset import raise_opset

        # on the proto, before the conversion: onnx.version_converter has no onnx-ir form, and the
        # op's bodies are rebuilt at ``opset`` before the passes inline them
        model = raise_opset(model, opset)
    return run_post_passes(model, contrib_ops, native)


MIN_EXTERNAL_BYTES = 1024
INLINE_MAX_BYTES = 1 << 16  # a made constant this small (rotate_half's matrix: 16 KiB) stays in the graph file


def _external(tensor) -> dict | None:
    import onnx

    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    return {e.key: e.value for e in tensor.external_data}


def _read(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def _weights_by_content(package: Path) -> dict[tuple[str, int], tuple[str, int, int]]:
    """(sha256, length) -> (location, offset, length) of every external initializer of model.onnx."""
    import onnx

    model = onnx.load(str(package / MODEL_FILE), load_external_data=False)
    out = {}
    for t in model.graph.initializer:
        info = _external(t)
        if info is None:
            continue
        offset, length = int(info.get("offset", 0)), int(info["length"])
        data = _read(package / info["location"], offset, length)
        out.setdefault((hashlib.sha256(data).hexdigest(), length), (info["location"], offset, length))
    return out


def save_optimized_graph(package: Path, plan: OrtGraphPlan) -> OrtOptimized:
    """Write ``model.ort.onnx`` (+ a ``model.ort.onnx.data`` only for initializers ORT made)
    into the ``package`` directory, which already holds ``model.onnx``, as ``plan`` says
    (its opset, contrib fusions, native decode node: :func:`prepared_graph`); returns its record,
    whose plan is the graph as built: the opset it has (the source's, with ``opset_why``, when the
    raise fails; a newer source's as is) and the native node only where a layer took it (else
    ``native_why`` says why none did)."""
    import onnx
    import onnxruntime as ort

    from ..cpu.node import VERSION
    from ..ops.node import onnx_opset
    from .native_decode import NATIVE_DOMAIN, not_native_note, session_options, uses_native
    from .ort_opset import OpsetRaiseError, opset_note

    contrib_ops, opset, native = plan.contrib_fusions, plan.opset, plan.native
    package = Path(package)
    with tempfile.TemporaryDirectory(prefix=".ort-graph.", dir=package) as tmp:
        tmp = Path(tmp)
        so = session_options()
        so.enable_cpu_mem_arena = False  # nothing kept after the session (weights.session_options)
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        so.optimized_model_filepath = str(tmp / ORT_GRAPH_FILE)
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "ort.data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                    str(MIN_EXTERNAL_BYTES))
        # Shapes resolved first (shared_shapes.py) so ORT merges the op's per-step bookkeeping
        # across layers; written beside model.onnx so its weights resolve to the same file.
        prepared = package / PREPARED_FILE
        source = onnx.load(str(package / MODEL_FILE), load_external_data=False)
        note = plan.opset_why
        try:
            graph = prepared_graph(source, contrib_ops, opset, native)
        except OpsetRaiseError as e:
            note = opset_note(onnx_opset(source), str(e))
            graph = prepared_graph(source, contrib_ops, native=native)
        built = replace(plan, opset=onnx_opset(graph), opset_why=note)
        if native and not uses_native(graph):
            built = replace(built, native_domain=None, native_version=None,
                            native_why=not_native_note(True, None, source))
        elif native:
            built = replace(built, native_domain=NATIVE_DOMAIN, native_version=VERSION)
        if uses_native(graph):
            from ..cpu import native as cpu_native

            cpu_native.register(so)
        onnx.save_model(graph, str(prepared))
        try:
            ort.InferenceSession(str(prepared), so, providers=["CPUExecutionProvider"])
        finally:
            prepared.unlink()

        optimized = onnx.load(str(tmp / ORT_GRAPH_FILE), load_external_data=False)
        weights = _weights_by_content(package)
        own = package / (ORT_GRAPH_FILE + ".data")
        shared = own_bytes = 0
        with open(own, "wb") as extra:
            for t in optimized.graph.initializer:
                info = _external(t)
                if info is None:
                    continue
                data = _read(tmp / info["location"], int(info.get("offset", 0)), int(info["length"]))
                where = weights.get((hashlib.sha256(data).hexdigest(), len(data)))
                if where is None and len(data) <= INLINE_MAX_BYTES:  # a small constant made here: in the graph
                    del t.external_data[:]
                    t.data_location = onnx.TensorProto.DEFAULT
                    t.raw_data = data
                    continue
                if where is None:  # made by ORT: keep it, in our own small file
                    where = (own.name, extra.tell(), len(data))
                    extra.write(data)
                    own_bytes += len(data)
                else:
                    shared += len(data)
                del t.external_data[:]
                for key, value in zip(("location", "offset", "length"), where):
                    t.external_data.add(key=key, value=str(value))
        if own_bytes == 0:
            os.remove(own)
        onnx.save_model(optimized, str(package / ORT_GRAPH_FILE))
    return OrtOptimized(file=ORT_GRAPH_FILE, onnxruntime=ort.__version__, level=LEVEL,
                        shared_bytes=shared, own_bytes=own_bytes, weights=MODEL_DATA_FILE, plan=built)
