"""Which form of ``model.ort.onnx`` the exporter keeps: the fastest one that validates, as a typed plan.

``ort_graph.prepared_graph`` can raise the graph to ai.onnx ``ORT_OPSET``
(``ort_opset.py``) and fuse ORT's contrib ops (``skip_norm.py``, ``rotary.py``).
Either can change the logits: the fused kernels round differently (SmolLM2: max
|logit diff| 4.3e-5 -> 6.9e-5 of the 1e-4 tolerance), and the raise rewrites the
main graph (``onnx.version_converter``) and the op's fine score (blocked
``DequantizeLinear``). :func:`validate_ort_graph` tries, in order: raised with the
fusions, raised without them, then the source's opset (with and without), and
keeps the first within the tolerance - the raised ones also checked with selection
on (:func:`sparse_agreement`), since the dense validation against the source never
runs the selection the raise changes - then tries the native decode node on it. The
result is a ``contracts.ort_plan.OrtGraphPlan`` (what to build, and why each choice
fell back: the manifest's ``ort_optimized.plan``) and the figures measured on the way
(the manifest's ``validation``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np
import onnx

from ..contracts.ort_plan import OrtGraphPlan
from ..ops.node import onnx_opset
from .ort_graph import prepared_graph
from .ort_opset import ORT_OPSET, opset_note

NO_NATIVE_DECODE = "package exported with --no-native-decode"
SPARSE_BUDGET_PAGES = 3  # with the op's 1 sink + 1 recent page forced: one page's worth chosen by score


def validate_ort_graph(proto: onnx.ModelProto, manifest: dict, tolerance: float,
                       check: Callable[[onnx.ModelProto], float], progress: Callable[[str], None],
                       native: bool = False, weights_dir=None) -> tuple[OrtGraphPlan, dict]:
    """(the plan of ``model.ort.onnx`` that validates, the validation's figures) for the graph made
    from ``proto`` (the rewritten portable model, weights loaded). The figures:
    ``ort_graph_max_abs_logit_diff``, ``ort_opset_sparse_check`` when raised and ``ort_native_check``
    when the native kernel was tried - measurements only; the choices and their reasons are the plan.
    ``check(graph)``: max |logit diff| of a graph against the source (the dense validation);
    ``weights_dir``: where ``proto``'s external weights resolve (``weights.py``)."""
    def best_at(opset: int | None) -> tuple[float, bool, str | None]:  # (figure, contrib ops kept, why not)
        figure = check(prepared_graph(proto, True, opset))
        if figure <= tolerance:
            return figure, True, None
        plain = check(prepared_graph(proto, False, opset))
        if plain < figure:  # the fused kernels' rounding: standard ops
            why = f"ORT contrib fusions give max |logit diff| {figure:.3g}; kept standard ops ({plain:.3g})"
            progress(why)
            return plain, False, why
        return figure, True, None

    def finish(plan: OrtGraphPlan, figures: dict) -> tuple[OrtGraphPlan, dict]:
        if not native:
            return replace(plan, native_why=NO_NATIVE_DECODE), figures
        return _with_native(plan, figures, proto, manifest, tolerance, check, progress, weights_dir)

    source, note = onnx_opset(proto), None
    if source < ORT_OPSET:
        try:
            figure, contrib, why = best_at(ORT_OPSET)
            sparse = sparse_agreement(proto, manifest, contrib, weights_dir=weights_dir) if figure <= tolerance else None
            if figure <= tolerance and (sparse[0] is None or sparse[0] <= tolerance):
                return finish(OrtGraphPlan(ORT_OPSET, contrib, fusions_why=why),
                              dict(ort_graph_max_abs_logit_diff=figure, ort_opset_sparse_check=sparse[1]))
            reason = (f"its max |logit diff| {figure:.3g} > {tolerance:g}" if sparse is None else
                      f"with selection on it differs from the opset-{source} graph by {sparse[0]:.3g} > {tolerance:g}")
        except Exception as e:  # OpsetRaiseError, or ORT refusing the converted graph: keep the source's
            reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        note = opset_note(source, reason)
        progress(note)
    figure, contrib, why = best_at(None)
    return finish(OrtGraphPlan(source, contrib, opset_why=note, fusions_why=why),
                  dict(ort_graph_max_abs_logit_diff=figure))


def _with_native(plan: OrtGraphPlan, figures: dict, proto: onnx.ModelProto, manifest: dict, tolerance: float,
                 check: Callable[[onnx.ModelProto], float], progress: Callable[[str], None],
                 weights_dir=None) -> tuple[OrtGraphPlan, dict]:
    """``plan`` calling the native CPU decode kernel (``native_decode.py``) when that graph is within
    ``tolerance`` of the source (dense, ``check``) and of the function graph with selection on
    (``sparse_agreement``); otherwise ``plan`` with ``native_why`` saying why. ``figures`` gains
    ``ort_native_check`` (the measurement, or why none was made)."""
    from ..cpu import native as cpu_native
    from ..cpu.node import VERSION
    from .native_decode import NATIVE_DOMAIN, unsupported

    reason = unsupported(proto) or cpu_native.available()
    if reason is not None:
        progress(f"native CPU decode kernel not used: {reason}")
        return (replace(plan, native_why=f"the native kernel was not used at export (skipped: {reason})"),
                dict(figures, ort_native_check=f"skipped: {reason}"))
    opset = None if plan.opset == onnx_opset(proto) else plan.opset
    try:
        dense = check(prepared_graph(proto, plan.contrib_fusions, opset, native=True))
        sparse = sparse_agreement(proto, manifest, plan.contrib_fusions, opset=opset, native=True,
                                  weights_dir=weights_dir)
    except Exception as e:  # a kernel error on this model: keep the function
        note = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        progress(f"native CPU decode kernel failed validation ({note}); the ORT graph keeps the function")
        return (replace(plan, native_why=f"the native kernel was not used at export (failed: {note})"),
                dict(figures, ort_native_check=f"failed: {note}"))
    record = f"dense max |logit diff| {dense:.3g} vs the source; {sparse[1]}"
    if not (dense <= tolerance and (sparse[0] is None or sparse[0] <= tolerance)):
        progress(f"native CPU decode kernel out of tolerance ({record}); the ORT graph keeps the function")
        return (replace(plan, native_why=f"the native kernel was out of tolerance at export ({record})"),
                dict(figures, ort_native_check=record))
    worst = max(figures["ort_graph_max_abs_logit_diff"], dense)
    return (replace(plan, native_domain=NATIVE_DOMAIN, native_version=VERSION),
            dict(figures, ort_native_check=record, ort_graph_max_abs_logit_diff=worst))


def sparse_agreement(proto: onnx.ModelProto, manifest: dict, contrib: bool, opset: int | None = ORT_OPSET,
                     native: bool = False, weights_dir=None) -> tuple[float | None, str]:
    """(max |logit diff|, a one-line record) of the ORT graph raised to ``opset`` against the one at
    the source's opset - or, ``native``, of the graph decoding on the native CPU kernel against the
    function graph at the same opset - decoding at a budget of ``SPARSE_BUDGET_PAGES`` pages
    (``validate.paged_logits``). The figure is None, and the record says why, when the reference
    graph itself cannot run those lengths (positions past a learned table, say)."""
    from .validate import graph_session, paged_logits, sparse_lengths

    budget, lengths = SPARSE_BUDGET_PAGES * manifest["page_size"], sparse_lengths(manifest["page_size"])
    where = f"at budget {budget}, prompts {list(lengths)} + 4 decode steps"
    base = opset if native else None
    name = (f"the function graph (opset {opset or onnx_opset(proto)})" if native
            else f"the opset-{onnx_opset(proto)} graph")

    def logits(at, on_kernel):
        session = graph_session(prepared_graph(proto, contrib, at, native=on_kernel), weights_dir)
        return paged_logits(session, manifest, budget, lengths)
    try:
        reference = logits(base, False)
    except Exception as e:  # nothing the raise could change: record it and go on
        return None, f"skipped: {name} fails {where} ({type(e).__name__})"
    worst = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(reference, logits(opset, native)))
    return worst, f"max |logit diff| {worst:.3g} vs {name} {where}"
