"""tinyserve-export's pipeline: load -> match -> probe -> rewrite -> check -> validate -> write.

``export_model`` returns an ``ExportReport``; errors are ``ExportError``s with
the exit code the CLI uses.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from .. import __version__
from ..contracts.cold_tier import describe_format, tier_codecs
from ..contracts.dense_layers import manifest_value as manifest_dense_layers
from ..contracts.manifest import ENGINE_FILE, MODEL_FILE, ColdTier, Manifest, PackageIO
from ..ops import schema
from ..ops.node import attach_functions
from . import checks
from .calibration_artifact import load_calibration, with_calibration
from .config import ExportConfig, resolve_max_context
from .errors import InputError, UnsupportedError
from .kv_io import LayerPlan, rewrite
from .native_decode import decode_summary
from .tier_fields import cold_tier_fields, two_level_fields
from .tolerance import check_within, validation_tolerance
from .outdir import check_output
from .package import StagedPackage, special_tokens, tokenizer_files, weight_bytes
from .progress import Progress
from .validate import SourceReference
from .weights import compacted, check_copy
from .probe import run_with_outputs, source_feeds, weights_dir as weights_dir_of
from .loader import file_sha256, find_attention, load_source
from .graph_io import find_source_io

SOURCE_WEIGHTS = ".source-weights"  # in the staging folder: a bf16 source widened to fp32 (bf16.py)

# Contexts at which masks are checked for sliding windows (past Mistral's 4096 first).
LONG_PROBE_PASTS = (4100, 1000, 250, 60)


@dataclass
class ExportReport:
    outdir: Path
    rule_counts: Counter
    layers: int
    validation: float | None
    size_bytes: int
    seconds: dict = field(default_factory=dict)
    weight_bytes: int = 0  # the model's initializers: the package holds them once
    head_dim: int = 0
    packed_matmuls: int = 0  # projections folded into a packed MatMul (pack_matmuls.py)
    source_opset: int | None = None  # ai.onnx opset of the source and of model.onnx
    ort_opset: int | None = None  # of model.ort.onnx (ort_opset.py); None: no ORT graph (trt backend)
    ort_opset_note: str | None = None  # why model.ort.onnx kept the source's opset
    ort_decode: str | None = None  # what decodes in model.ort.onnx: the native kernel or the function, and why
    int8_layers: tuple = ()  # an int4 package's INT8 cold layers (issue #17)
    int8_layers_source: str | None = None  # where they came from
    tolerance: float | None = None  # the validation's bound (tolerance.py)
    source_noise: float | None = None  # the source's own float32 noise (SourceReference.noise)
    kv_dtype: str = "float32"  # the KV pages'
    max_context: int | None = None  # what the package serves, and where that came from
    max_context_from: str = ""


def _progress(msg: str, quiet: bool) -> None:
    if not quiet:
        import sys
        print(f"tinyserve-export: {msg}", file=sys.stderr, flush=True)


def export_model(source: str | Path, outdir: str | Path, config: ExportConfig = ExportConfig(),
                 overwrite: bool = False, quiet: bool = False, extra_manifest: dict | None = None,
                 int8_pick=None) -> ExportReport:
    """``int8_pick``: the sensitivity pass's ``calibration.int8_pick.Int8Pick`` when
    ``config.runs_int8_pass()``; None runs it as a stage over the written package, before it is
    swapped in (``auto_int8.py``: the export writes every layer INT4, the stage retypes the picked ones)."""
    source, outdir = Path(source), Path(outdir)
    check_output(outdir, overwrite, (source,))  # before minutes of work; nothing touched yet
    config, context_from = resolve_max_context(config, source)
    int8_stage = config.runs_int8_pass() and int8_pick is None
    if int8_stage:
        from .auto_int8 import WRITING

        _progress(WRITING, quiet)
        config = replace(config, int8_layers="none")  # the stage sets int8_layers and where they came from
    times = {}
    if config.backend == "trt":  # fail before minutes of work, not after
        from .trt_build import require_tensorrt

        require_tensorrt()
    artifact = load_calibration(config)
    with StagedPackage(outdir, overwrite) as stage:  # removed on any failure; OUTDIR untouched
        report = _export(stage, source, config, artifact, quiet, extra_manifest, int8_pick, times, int8_stage)
    return replace(report, max_context=config.max_context, max_context_from=context_from)


def _export(stage, source: Path, config: ExportConfig, artifact, quiet: bool, extra_manifest, int8_pick,
            times: dict, int8_stage: bool = False) -> ExportReport:
    """load -> match -> probe -> rewrite, then :func:`_validate_and_write` into ``stage``."""
    t0 = time.perf_counter()
    bar = Progress(quiet)
    bar.start("load", f"loading {source}")
    model, reference = load_source(source, stage.path / SOURCE_WEIGHTS)  # large weights stay on disk (weights.py)
    if reference != source:
        bar.note("bfloat16 source: widened to float32 (ONNX Runtime's CPU EP has no bf16 kernels); "
                 "validated against the widened model")
    weights_dir = Path(weights_dir_of(model) or source.parent)
    sha = file_sha256(source)
    times["load"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    bar.start("match", "matching attention blocks")
    matches, counts = find_attention(model)
    cache_in = {m.key.past_input for m in matches} | {m.value.past_input for m in matches}
    cache_out = {m.key.present for m in matches} | {m.value.present for m in matches}
    io = find_source_io(model.graph, cache_in, cache_out)
    past_inputs = [v for v in model.graph.inputs if v in cache_in]
    plans, dims = _plan_layers(model, matches, io, past_inputs, config)
    source_io = dict(input_ids=io.input_ids.name, attention_mask=io.attention_mask.name if io.attention_mask else None,
                     position_ids=io.position_ids.name if io.position_ids else None, logits=io.logits.name,
                     past_inputs=[v for m in matches for v in (m.key.past_input.name, m.value.past_input.name)],
                     present_outputs=[v for m in matches for v in (m.key.present.name, m.value.present.name)])
    times["match"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    bar.start("rewrite", f"rewriting {len(plans)} attention blocks ({dict(counts)})")
    page_size = config.resolved_page_size()
    dtype = ir.DataType.FLOAT16 if config.fp16 else ir.DataType.FLOAT if config.fp32_kv \
        else plans[0].match.key.past_input.dtype  # the source's cache dtype
    if dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):  # the op's pages: fp32 or fp16
        raise UnsupportedError(f"the source's KV cache is {dtype.name.lower()}; the op's pages are float32 or "
                               "float16: export the model in fp16 or fp32")
    cold_tier = cold_tier_fields(config, artifact, len(plans), dims, int8_pick) if config.has_cold_tier else None
    cold = tier_codecs(asdict(cold_tier), len(plans)) if cold_tier else None  # per layer (int8_layers)
    paged = rewrite(model, plans, io, page_size, dtype, config.last_token_logits, cold)
    from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

    RemoveUnusedNodesPass()(model)
    TopologicalSortPass()(model)
    model.ir_version = max(model.ir_version or 0, 10)  # function overloads need IR 10
    proto = attach_functions(ir.to_proto(model))
    packed = 0
    if config.pack_projections:
        from .pack_matmuls import pack_shared_matmuls

        packed = pack_shared_matmuls(proto, weights_dir)
    times["rewrite"] = time.perf_counter() - t0
    done = _Rewritten(proto, plans, dims, counts, source_io, paged, page_size, packed, cold_tier,
                      "float16" if dtype == ir.DataType.FLOAT16 else "float32", reference)
    del proto, model  # ``done`` holds the one reference, which the write stage replaces (weights.compacted)
    return _validate_and_write(stage, source, weights_dir, sha, done, config, artifact, extra_manifest, times, bar,
                               int8_stage and (lambda msg: _progress(msg, quiet)))


@dataclass
class _Rewritten:
    """What the rewrite made: the stages that write, check and validate it read this."""
    proto: onnx.ModelProto  # large weights: external references into the source's files
    plans: list
    dims: dict
    counts: Counter
    source_io: dict
    paged: object
    page_size: int
    packed: int
    cold_tier: ColdTier | None
    kv_dtype: str  # the pages': the source's cache dtype, float16 with --fp16, float32 with --fp32-kv
    reference: Path  # what sessions of the source load: the user's file, or its widened copy (bf16.py)


def _validate_and_write(stage, source: Path, weights_dir: Path, sha: str, done: _Rewritten, config: ExportConfig, artifact,
                        extra_manifest, times: dict, bar: Progress, int8_stage=None) -> ExportReport:
    """Write the rewritten model into ``stage`` (its weights streamed from the source's files), check
    and validate it there, then finish and swap in the package. ``int8_stage``: a progress callable
    when the INT8-layer stage (``auto_int8.py``) runs on the staged package before it is finished."""
    proto, plans, dims, counts, cold_tier = done.proto, done.plans, done.dims, done.counts, done.cold_tier
    t0 = time.perf_counter()
    bar.start("write", "writing model.onnx and model.onnx.data", total=weight_bytes(proto), unit="B")
    weights = stage.write_model(proto, weights_dir, bar.advance)  # proto now points at the package's data file
    done.proto = proto = compacted(proto)  # frees the packed projections' bytes, still in the old message's arena
    times["write"] = time.perf_counter() - t0
    try:
        onnx.checker.check_model(check_copy(proto), full_check=True)
    except Exception as e:
        raise UnsupportedError(f"rewritten model fails onnx.checker: {str(e).splitlines()[0][:200]}") from None

    files = tokenizer_files(source)
    manifest = Manifest(
        tool_version=__version__, op=dict(domain=schema.DOMAIN, name=schema.OP_TYPE, version=schema.VERSION),
        num_layers=len(plans), num_heads=dims["heads"], num_kv_heads=dims["kv_heads"], head_dim=dims["head_dim"],
        vocab_size=dims["vocab"], page_size=done.page_size, token_budget=config.token_budget,
        budget_share=config.budget_share, group_reduce=config.resolved_group_reduce,
        dense_layers=manifest_dense_layers(config.dense_layers, len(plans)), policy=config.policy,
        sink_pages=config.sink_pages,
        recent_pages=config.recent_pages, dtype=done.kv_dtype,
        max_context=config.max_context, io=PackageIO(done.paged.inputs, done.paged.outputs, done.paged.layers),
        source=dict(path=source.name, sha256=sha, rules=dict(counts), opset=_onnx_opset(proto)),
        source_io=done.source_io, backend=config.backend, cold_tier=cold_tier, **special_tokens(files),
        **two_level_fields(plans, config), extra=dict(extra_manifest or {}),
    )

    figure = plan = None  # plan: the validated OrtGraphPlan of model.ort.onnx (None: not validated)
    if config.validate:
        t0 = time.perf_counter()
        runs = 3 if config.backend == "trt" else 4 + bool(config.native_decode)  # sessions, about
        bar.start("validate", "validating against the original (prefill + 8 decode steps, batch 2, dense)",
                  total=runs, unit="runs")
        reference = SourceReference(done.reference, stage.path, on_run=bar.advance)
        tolerance, noise = validation_tolerance(config, reference, manifest.to_dict())
        figure = _validate(reference, proto, manifest.to_dict())
        bar.advance()
        validation = dict(max_abs_logit_diff=figure, tolerance=tolerance, source_noise=noise)
        if config.backend != "trt":  # the CPU runtime loads model.ort.onnx, made from this graph
            from .ort_validation import validate_ort_graph

            plan, figures = validate_ort_graph(
                proto, manifest.to_dict(), tolerance,
                lambda graph: (_validate(reference, graph, manifest.to_dict()), bar.advance())[0],
                bar.note, native=config.native_decode, weights_dir=stage.path)
            validation.update(model_max_abs_logit_diff=figure, **figures)
            figure = validation["max_abs_logit_diff"] = max(figure, figures["ort_graph_max_abs_logit_diff"])  # checked
        if cold_tier:  # the cold path itself is checked by tests/ops (vs the reference) and tests/runtime
            fmt = describe_format(cold_tier.cold_format, cold_tier.int8_layers).upper()
            validation["pages"] = f"all hot (the cold-tier inputs hold one unused page per layer, {fmt})"
        manifest = replace(manifest, validation=validation)
        times["validate"] = time.perf_counter() - t0
        check_within(figure, tolerance, config)
    shutil.rmtree(stage.path / SOURCE_WEIGHTS, ignore_errors=True)
    t0 = time.perf_counter()
    outdir = stage.outdir
    bar.start("package", f"writing {outdir}" + (" and building the TensorRT engine" if config.backend == "trt" else ""))
    finalize = _build_trt_engine(config) if config.backend == "trt" else _ort_graph_saver(config, plan)
    if int8_stage:
        from .auto_int8 import int8_stage as stage_hook

        finalize = stage_hook(finalize, int8_stage, times)
    if artifact is not None:
        finalize = with_calibration(finalize, artifact)
    size, written = stage.commit(manifest, files, finalize)
    bar.end()
    times["write"] += time.perf_counter() - t0 - times.get("int8 layers", 0.0)
    ort_graph, cold_tier = written.ort_optimized, written.cold_tier
    return ExportReport(outdir, counts, len(plans), figure, size, times, weights, dims["head_dim"], done.packed,
                        source_opset=manifest.source["opset"], ort_opset=ort_graph.opset if ort_graph else None,
                        ort_opset_note=ort_graph.opset_note if ort_graph else None,
                        ort_decode=decode_summary(ort_graph),
                        int8_layers=tuple(cold_tier.int8_layers) if cold_tier else (),
                        int8_layers_source=cold_tier.int8_layers_source if cold_tier else None,
                        tolerance=(manifest.validation or {}).get("tolerance"),
                        source_noise=(manifest.validation or {}).get("source_noise"), kv_dtype=done.kv_dtype)


def _ort_graph_saver(config: ExportConfig, plan=None):
    """Save ONNX Runtime's optimized graph next to the portable model, sharing its weights
    file (``ort_graph.py``): the runtime starts ~3x faster from it. It is built as ``plan`` says
    (the validated ``OrtGraphPlan``, ``ort_validation.py``); unvalidated, as :func:`unvalidated_plan`."""
    def finalize(tmp: Path, manifest: Manifest) -> Manifest:
        return _save_ort_graph(tmp, manifest, config.native_decode, plan)

    return finalize


def unvalidated_plan(native: bool):
    """The plan of an unvalidated ORT graph: the preferred one - raised opset, contrib fusions, the
    native decode node when ``native`` and it builds here."""
    from ..contracts.ort_plan import OrtGraphPlan
    from ..cpu import native as cpu_native
    from ..cpu.node import VERSION
    from .native_decode import NATIVE_DOMAIN, not_native_note
    from .ort_opset import ORT_OPSET

    unavailable = cpu_native.available() if native else None
    if native and unavailable is None:
        return OrtGraphPlan(ORT_OPSET, True, native_domain=NATIVE_DOMAIN, native_version=VERSION)
    return OrtGraphPlan(ORT_OPSET, True, native_why=not_native_note(native, unavailable))


def _save_ort_graph(tmp: Path, manifest: Manifest, native: bool = True, plan=None) -> Manifest:
    from .ort_graph import save_optimized_graph

    record = save_optimized_graph(tmp, plan if plan is not None else unvalidated_plan(native))
    return replace(manifest, ort_optimized=record)


def _build_trt_engine(config: ExportConfig):
    """A hook that builds ``model.plan`` inside the package's temporary directory,
    with one optimization profile over every dynamic input (``contracts.engine_profiles``)."""
    from ..contracts.engine_profiles import engine_profiles
    from .trt_build import build_engine

    def finalize(tmp: Path, manifest: Manifest) -> Manifest:
        profiles, limits = engine_profiles(manifest.to_dict(), config.max_context)
        build_engine(tmp / MODEL_FILE, tmp / ENGINE_FILE, profiles, fp16=config.fp16)
        return replace(manifest, engine=dict(file=ENGINE_FILE, **limits))

    return finalize


def _onnx_opset(proto: onnx.ModelProto) -> int:
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


def _plan_layers(model, matches, io, past_inputs, config: ExportConfig):
    """Head counts, scales and mask checks from probe runs of the source."""
    mask_values = [mk.value for m in matches for mk in m.masks]
    scale_values = [v for m in matches for _, v, _ in m.scale_factors]
    short = (2, 5, 3)  # batch, past, new tokens
    donors = [v for m in matches for v in (m.query, m.key.new, m.value.new)]
    cache_side = [v for m in matches for v in (m.key.present, m.value.present, *m.chain_values)]
    values = run_with_outputs(model, donors + mask_values + scale_values + cache_side + [io.logits],
                              source_feeds(model.graph, io, past_inputs, *short))
    for m in matches:
        checks.check_masks(m, values, short[1], short[2])
    if mask_values:
        for past in LONG_PROBE_PASTS:  # longest context the model accepts (learned positions cap it)
            try:
                long = run_with_outputs(model, mask_values, source_feeds(model.graph, io, past_inputs, 1, past, 1))
            except Exception:
                continue
            for m in matches:
                checks.check_masks(m, long, past, 1)
            break
    try:
        config.dense_layer_set(len(matches))
    except ValueError as e:
        raise InputError(f"--dense-layers: {e}") from None
    plans = []
    for i, m in enumerate(matches):
        q, k = values[m.query.name], values[m.key.new.name]
        if q.ndim != 4 or k.ndim != 4 or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
            raise UnsupportedError(f"attention at {m.where()}: query {q.shape} / key {k.shape} are not "
                                   "[B, H, S, D] / [B, Hkv, S, D] with H a multiple of Hkv")
        scale = checks.resolve_scale(m, values)
        if scale and abs(scale - q.shape[3] ** -0.5) < 1e-6 * q.shape[3] ** -0.5:
            scale = 0.0  # the default; keeps the op's attribute readable
        plans.append(LayerPlan(m, config.layer_attributes(i, scale), q.shape[1], k.shape[1], q.shape[3],
                               _shape_donors(m, values)))
    logits = values[io.logits.name]
    dims = dict(heads=plans[0].num_heads, kv_heads=plans[0].num_kv_heads, head_dim=plans[0].head_dim,
                vocab=int(logits.shape[-1]))
    if any((p.num_heads, p.num_kv_heads, p.head_dim) != (dims["heads"], dims["kv_heads"], dims["head_dim"])
           for p in plans):
        raise UnsupportedError("layers with different head counts or head dims are not supported")
    return plans, dims


def _shape_donors(m, values) -> dict:
    """For each value between the cache and the attention, a value computed
    without the cache whose shape is the same but for the sequence axis (-2):
    the new K/V before the GQA repeat, the query after it."""
    donors = {}
    for v in [m.key.present, m.value.present, *m.chain_values]:
        shape = values[v.name].shape
        for d in (m.key.new, m.query):
            ds = values[d.name].shape
            if len(ds) == len(shape) >= 2 and ds[:-2] == shape[:-2] and ds[-1] == shape[-1]:
                donors[v] = d
                break
    return donors


def _validate(reference, proto: onnx.ModelProto, manifest: dict) -> float:
    """Max |logit diff| of the rewritten graph ``proto`` against the source (``reference``: a
    ``validate.SourceReference``, which also says where ``proto``'s weights resolve)."""
    from .validate import graph_session, validate

    session = graph_session(proto, reference.weights_dir)
    try:
        return validate(reference, session, manifest).max_abs_diff
    finally:
        del session


__all__ = ["export_model", "ExportReport", "np"]


