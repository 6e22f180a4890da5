"""``--int8-layers auto``: a stage over the written package that picks its INT8 layers (issue #17).

The default for an int4 cold tier without ``--calibration``. The export runs once, with every
layer INT4 (validated as asked); :func:`int8_stage` then runs in its staging folder, before the
folder is swapped into OUTDIR: it makes the ORT graph (as the plan says), saves the manifest
there, runs the layer sensitivity pass on that package through the runtime
(``calibration.int8_pick``: 2 pieces of the built-in text, up to 2048 tokens each, the next token
at each one's last 8, the format's default hot share, ``default_int8_layers_count(L)`` layers),
and :func:`apply_int8_layers` retypes the picked layers in place - their cold inputs, ``cold_format``
attribute and function overload become INT8's (``contracts.cold_tier.tier_codecs``), ``model.onnx``
is replaced atomically, the weights file is untouched - and the ORT graph is made again from it
(the same plan). The manifest's ``cold_tier.int8_layers_source``
says ``auto: layer sensitivity on the built-in text, 2 prompts`` and ``cold_tier.int8_layers_kl``
holds the per-layer KL; the summary's time line shows the pass as ``int8 layers``. A failure leaves
OUTDIR as it was (the staging folder is removed). The validation ran with every page hot, which
the cold format does not enter.
This is the one place export reaches into calibration (and through it the runtime): the
measurement needs the package it just wrote to run (``contracts.LAYERS``).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from ..contracts.manifest import MODEL_FILE, Manifest
from ..ops import schema
from .errors import UnsupportedError

WRITING = "picking INT8 layers: writing the package with every layer INT4"


def int8_stage(then, progress, times: dict):
    """A package hook (``StagedPackage.commit``'s ``finalize``): the INT8 pick, then ``then``
    (the ORT graph or the TensorRT engine, made from the retyped model). ``times["int8 layers"]``:
    the pass's seconds."""
    def finalize(folder: Path, manifest: Manifest) -> Manifest:
        from ..calibration.int8_pick import PASS_POSITIONS, PASS_PROMPTS, PASS_TOKENS, pick_int8_layers  # noqa: PLC0415

        t0 = time.perf_counter()
        progress(f"picking INT8 layers: each layer's sensitivity to INT4 cold pages on {PASS_PROMPTS} prompts of "
                 f"up to {PASS_TOKENS} tokens of the built-in text (the next token at the last {PASS_POSITIONS} of each)")
        if manifest.backend == "ort":  # measured on the graph the runtime serves (model.ort.onnx), remade below
            manifest = then(folder, manifest)
        manifest.save(folder)  # the runtime reads the package as written so far
        try:
            pick = pick_int8_layers(folder)
        except Exception as e:  # noqa: BLE001 - the runtime's failure, as one line
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UnsupportedError(f"picking INT8 layers failed on the all-INT4 package ({type(e).__name__}: "
                                   f"{first[:200]}); pass --int8-layers none, layer indices or --calibration") from None
        manifest = apply_int8_layers(folder, manifest, pick.layers, pick.describe(), pick.layer_kl)
        times["int8 layers"] = time.perf_counter() - t0
        progress(f"picking INT8 layers: {','.join(map(str, pick.layers)) or 'none'} ({pick.describe()}; "
                 f"{times['int8 layers']:.1f}s)")
        return then(folder, replace(manifest, ort_optimized=None))

    return finalize


def apply_int8_layers(folder: Path, manifest: Manifest, layers, source: str, layer_kl=None) -> Manifest:
    """Retype ``layers`` of the all-INT4 package in ``folder`` to INT8 cold pages, in place:
    ``model.onnx`` (replaced atomically; its weights file untouched) and the returned manifest's
    ``cold_tier`` (``int8_layers``, ``int8_layers_source`` = ``source``, ``int8_layers_kl``).
    ValueError for a package that is not all INT4 or a layer out of range."""
    import onnx

    from ..contracts.cold_tier import describe_format, tier_codecs
    from ..ops.node import attach_functions, node_attributes
    from .weights import check_copy

    tier = manifest.cold_tier
    if tier is None or tier.cold_format != "int4" or tier.int8_layers:
        raise ValueError("the INT8-layer stage runs on an int4 package whose layers are all INT4")
    layers = sorted({int(i) for i in layers})
    if any(not 0 <= i < manifest.num_layers for i in layers):
        raise ValueError(f"int8 layers {layers} out of range: the model has {manifest.num_layers} layers")
    tier = replace(tier, int8_layers=layers, int8_layers_source=source,
                   int8_layers_kl=None if layer_kl is None else [float(x) for x in layer_kl])
    codecs = tier_codecs(asdict(tier), manifest.num_layers)
    model = onnx.load(str(folder / MODEL_FILE), load_external_data=False)
    inputs = {vi.name: vi for vi in model.graph.input}
    consumers = {i: n for n in model.graph.node if n.domain == schema.DOMAIN and n.op_type == schema.OP_TYPE
                 for i in n.input if i}
    hkv, ps, d = manifest.num_kv_heads, manifest.page_size, manifest.head_dim
    for i in layers:
        codec, names = codecs[i], manifest.io.layers[i]
        dims = [codec.pool_shape(hkv, ps, d)] * 2 + [codec.scale_shape(w, hkv, ps, d) for w in "kv"]
        for role, dtype, shape in zip(schema.COLD_INPUTS, schema.COLD_DTYPES[codec.cold_format], dims):
            vi = inputs[names[role]]
            elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
            vi.CopyFrom(onnx.helper.make_tensor_value_info(vi.name, elem, ["num_cold_pages", *shape]))
        node = consumers[names[schema.COLD_INPUTS[0]]]
        attrs = replace(node_attributes(node), cold_format=codec.cold_format)
        for a in node.attribute:
            if a.name == "cold_format":
                a.s = codec.cold_format.encode()
        node.overload = attrs.function_overload(True)
    used = {n.overload for n in model.graph.node if n.domain == schema.DOMAIN and n.op_type == schema.OP_TYPE}
    kept = [f for f in model.functions if (f.domain, f.name) != (schema.DOMAIN, schema.OP_TYPE) or f.overload in used]
    del model.functions[:]
    model.functions.extend(kept)
    attach_functions(model)
    onnx.checker.check_model(check_copy(model), full_check=True)
    fd, tmp = tempfile.mkstemp(prefix=".model.", suffix=".onnx", dir=folder)
    os.close(fd)
    try:
        onnx.save_model(model, tmp)
        os.replace(tmp, folder / MODEL_FILE)
    except BaseException:
        os.unlink(tmp)
        raise
    validation = manifest.validation
    if validation and "pages" in validation:
        fmt = describe_format(tier.cold_format, tier.int8_layers).upper()
        validation = dict(validation, pages=f"all hot (the cold-tier inputs hold one unused page per layer, {fmt})")
    return replace(manifest, cold_tier=tier, validation=validation)
