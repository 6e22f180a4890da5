"""Which form of ``model.ort.onnx`` the exporter keeps: the fastest one that validates.

``ort_graph.prepared_graph`` can raise the graph to ai.onnx ``ORT_OPSET``
(``ort_opset.py``) and fuse ORT's contrib ops (``skip_norm.py``, ``rotary.py``).
Either can change the logits: the fused kernels round differently (SmolLM2: max
|logit diff| 4.3e-5 -> 6.9e-5 of the 1e-4 tolerance), and the raise rewrites the
main graph (``onnx.version_converter``) and the op's fine score (blocked
``DequantizeLinear``). :func:`validate_ort_graph` tries, in order: raised with the
fusions, raised without them, then the source's opset (with and without), and
keeps the first within the tolerance - the raised ones also checked with selection
on (:func:`sparse_agreement`), since the dense validation against the source never
runs the selection the raise changes. Falling back to the source's opset leaves a
one-line note (``ort_opset_note``) in the manifest's ``validation``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx

from ..ops.node import onnx_opset
from .ort_graph import prepared_graph
from .ort_opset import ORT_OPSET, opset_note

SPARSE_BUDGET_PAGES = 3  # with the op's 1 sink + 1 recent page forced: one page's worth chosen by score


def validate_ort_graph(proto: onnx.ModelProto, manifest: dict, tolerance: float,
                       check: Callable[[onnx.ModelProto], float], progress: Callable[[str], None],
                       native: bool = False, weights_dir=None) -> dict:
    """The ``validation`` fields of the ORT graph made from ``proto`` (the rewritten portable model,
    weights loaded): ``ort_graph_max_abs_logit_diff``, ``ort_contrib_ops``, ``ort_opset``, and
    ``ort_opset_sparse_check`` / ``ort_opset_note`` when raised / kept at the source opset.
    ``check(graph)``: max |logit diff| of a graph against the source (the dense validation);
    ``weights_dir``: where ``proto``'s external weights resolve (``weights.py``)."""
    def best_at(opset: int | None) -> tuple[float, bool]:  # (max |logit diff|, contrib ops kept)
        figure = check(prepared_graph(proto, True, opset))
        if figure <= tolerance:
            return figure, True
        plain = check(prepared_graph(proto, False, opset))
        if plain < figure:  # the fused kernels' rounding: standard ops
            progress(f"ORT contrib fusions give max |logit diff| {figure:.3g}; kept standard ops ({plain:.3g})")
            return plain, False
        return figure, True

    source, note = onnx_opset(proto), None
    if source < ORT_OPSET:
        try:
            figure, contrib = best_at(ORT_OPSET)
            sparse = sparse_agreement(proto, manifest, contrib, weights_dir=weights_dir) if figure <= tolerance else None
            if figure <= tolerance and (sparse[0] is None or sparse[0] <= tolerance):
                out = dict(ort_graph_max_abs_logit_diff=figure, ort_contrib_ops=contrib, ort_opset=ORT_OPSET,
                           ort_opset_sparse_check=sparse[1])
                return _with_native(out, proto, manifest, tolerance, check, progress, weights_dir) if native else out
            reason = (f"its max |logit diff| {figure:.3g} > {tolerance:g}" if sparse is None else
                      f"with selection on it differs from the opset-{source} graph by {sparse[0]:.3g} > {tolerance:g}")
        except Exception as e:  # OpsetRaiseError, or ORT refusing the converted graph: keep the source's
            reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        note = opset_note(source, reason)
        progress(note)
    figure, contrib = best_at(None)
    out = dict(ort_graph_max_abs_logit_diff=figure, ort_contrib_ops=contrib, ort_opset=source)
    out = out if note is None else dict(out, ort_opset_note=note)
    return _with_native(out, proto, manifest, tolerance, check, progress, weights_dir) if native else out


def _with_native(out: dict, proto: onnx.ModelProto, manifest: dict, tolerance: float,
                 check: Callable[[onnx.ModelProto], float], progress: Callable[[str], None],
                 weights_dir=None) -> dict:
    """``out`` plus ``ort_native`` (True: ``model.ort.onnx`` decodes on the native CPU kernel,
    ``native_decode.py``) and ``ort_native_check``: the native graph is kept only when it is within
    ``tolerance`` of the source (dense, ``check``) and of the function graph with selection on
    (``sparse_agreement``); otherwise the record says why and the graph keeps the function."""
    from ..cpu import native as cpu_native
    from .native_decode import unsupported

    reason = unsupported(proto) or cpu_native.available()
    if reason is not None:
        progress(f"native CPU decode kernel not used: {reason}")
        return dict(out, ort_native=False, ort_native_check=f"skipped: {reason}")
    contrib, opset = out["ort_contrib_ops"], out["ort_opset"]
    opset = None if opset == onnx_opset(proto) else opset
    try:
        dense = check(prepared_graph(proto, contrib, opset, native=True))
        sparse = sparse_agreement(proto, manifest, contrib, opset=opset, native=True, weights_dir=weights_dir)
    except Exception as e:  # a kernel error on this model: keep the function
        note = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        progress(f"native CPU decode kernel failed validation ({note}); the ORT graph keeps the function")
        return dict(out, ort_native=False, ort_native_check=f"failed: {note}")
    ok = dense <= tolerance and (sparse[0] is None or sparse[0] <= tolerance)
    record = f"dense max |logit diff| {dense:.3g} vs the source; {sparse[1]}"
    if not ok:
        progress(f"native CPU decode kernel out of tolerance ({record}); the ORT graph keeps the function")
    return dict(out, ort_native=ok, ort_native_check=record,
                ort_graph_max_abs_logit_diff=max(out["ort_graph_max_abs_logit_diff"], dense) if ok
                else out["ort_graph_max_abs_logit_diff"])


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
