"""Raise the ORT graph's ai.onnx opset, so the op's body can use the newer ops' faster forms.

The op's function body is written at its model's opset (a function imports the
same ai.onnx version as the model). The legacy torch exporter writes opset 17, where
the two-level fine score decodes its 4-bit sub-page bounds with Cast, Mul and
Floor passes; from opset 21 it is two blocked ``DequantizeLinear`` ops
(``ops/policies.py``: 0.66x the time per layer at 8K, batch 8,
``benchmarks/results/two_level_stage2_microbench.md``).

:func:`raise_opset` converts the main graph with ``onnx.version_converter`` and
rebuilds the op's bodies at the new opset (``ops/node.attach_functions``) before
``ort_graph.prepared_graph`` inlines them. Only ``model.ort.onnx`` is raised: the
portable ``model.onnx`` (what TensorRT parses) keeps the source's opset. The
exporter validates the raised graph like the portable one and keeps the source
opset, with a note in the manifest, when conversion or validation fails
(``pipeline.py``).
"""

from __future__ import annotations

from contextlib import contextmanager

import onnx

from ..ops import schema
from ..ops.node import attach_functions, onnx_opset
from ..ops.policies import BLOCKED_DQ_OPSET

ORT_OPSET = BLOCKED_DQ_OPSET  # the lowest opset with every fast form the op's body has


class OpsetRaiseError(Exception):
    """``onnx.version_converter`` could not convert the graph; the message is one line."""


def raise_opset(model: onnx.ModelProto, target: int = ORT_OPSET) -> onnx.ModelProto:
    """``model`` (weights loaded or external) at ai.onnx opset ``target``: the main graph converted,
    other local functions inlined first (the converter does not convert function bodies), the op's
    bodies rebuilt at ``target``. A model already at ``target`` or later is returned as is.
    Does not modify ``model``; raises :class:`OpsetRaiseError` when the converter fails."""
    from onnx import inliner, version_converter

    if onnx_opset(model) >= target:
        return model
    work = onnx.ModelProto()
    with weights_detached(model) as big:
        work.CopyFrom(model)
    others = [onnx.FunctionProto.FromString(f.SerializeToString()) for f in work.functions
              if (f.domain, f.name) != (schema.DOMAIN, schema.OP_TYPE)]
    del work.functions[:]  # the op's bodies are rebuilt at ``target`` below
    if others:
        work.functions.extend(others)
        work = inliner.inline_local_functions(work)
    try:
        converted = version_converter.convert_version(work, target)
    except Exception as e:  # the converter raises RuntimeError, ValueError, onnx's own errors
        raise OpsetRaiseError(f"onnx.version_converter {onnx_opset(model)} -> {target} failed: "
                              f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}") from None
    for t in converted.graph.initializer:
        if t.name in big:
            t.raw_data = big[t.name]
    # The converter types every value by inference without data propagation: a Reshape by a
    # computed shape gets all-unknown dims, which later inference (data_prop on) keeps, so the
    # shared-shape pass would miss every layer after the first. The source's own value_info stays.
    del converted.graph.value_info[:]
    converted.graph.value_info.extend(work.graph.value_info)
    return attach_functions(converted)


@contextmanager
def weights_detached(model: onnx.ModelProto):
    """Large initializers' bytes taken out for the block (copying and converting read none);
    yields name -> bytes; restores them after."""
    big = [(t, t.raw_data) for t in model.graph.initializer if len(t.raw_data) > (1 << 16)]
    try:
        for t, _ in big:
            t.ClearField("raw_data")
        yield {t.name: data for t, data in big}
    finally:
        for t, data in big:
            t.raw_data = data


def opset_note(source_opset: int, reason: str) -> str:
    """The one-line note of a graph kept at the source opset."""
    return f"model.ort.onnx kept at ai.onnx opset {source_opset} (not {ORT_OPSET}): {reason}"
