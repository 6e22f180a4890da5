"""The source export's interface, found by structure: which graph input is the
token ids, the attention mask, the positions; which output is the logits."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from .errors import InputError
from .graph_walk import consumers

INT_TYPES = ("INT64", "INT32")


@dataclass
class SourceIO:
    input_ids: ir.Value
    attention_mask: ir.Value | None
    position_ids: ir.Value | None
    logits: ir.Value


def _dims(v: ir.Value) -> tuple:
    return tuple(v.shape.dims) if v.shape is not None else ()


def _table_rows(v: ir.Value, depth: int = 0) -> int | None:
    """Rows of the embedding table ``v`` indexes (through reshapes/casts), if any."""
    for n in consumers(v):
        if n.op_type == "Gather" and n.inputs[1] is v and n.inputs[0].is_initializer() and n.inputs[0].shape:
            return n.inputs[0].shape.dims[0]
        if n.op_type in ("Reshape", "Cast", "Flatten", "Unsqueeze", "Squeeze", "Identity") and depth < 4 \
                and n.inputs[0] is v:
            rows = _table_rows(n.outputs[0], depth + 1)
            if rows is not None:
                return rows
    return None


def _pick_token_ids(ids: list[ir.Value], graph: ir.Graph, cache_outputs) -> ir.Value:
    """Several int inputs feed embedding tables (GPT-2: tokens and learned
    positions): the token table has the logits' vocabulary; if sizes tie, the
    exporters' name decides."""
    logits = [v for v in graph.outputs if v not in cache_outputs and len(_dims(v)) == 3]
    vocab = _dims(logits[0])[2] if logits else None
    by_vocab = [v for v in ids if isinstance(vocab, int) and _table_rows(v) == vocab]
    if len(by_vocab) == 1:
        return by_vocab[0]
    named = [v for v in ids if (v.name or "").endswith("input_ids")]
    if len(named) == 1:
        return named[0]
    raise InputError(f"cannot tell the token-ids input among {[v.name for v in ids]} (several embedding inputs "
                     "with vocabulary-sized tables)")


def find_source_io(graph: ir.Graph, cache_inputs: set[ir.Value], cache_outputs: set[ir.Value]) -> SourceIO:
    ints = [v for v in graph.inputs if v not in cache_inputs and v.dtype is not None and v.dtype.name in INT_TYPES]
    ids = [v for v in ints if _table_rows(v) is not None]
    if not ids:
        raise InputError("no token-ids input found (an int input feeding an embedding Gather): "
                         "is this a decoder LLM export?")
    input_ids = ids[0] if len(ids) == 1 else _pick_token_ids(ids, graph, cache_outputs)
    seq_dim = _dims(input_ids)[1] if len(_dims(input_ids)) == 2 else None
    others = [v for v in ints if v is not input_ids and len(_dims(v)) == 2]
    position_ids = next((v for v in others if seq_dim is not None and _dims(v)[1] == seq_dim), None)
    attention_mask = next((v for v in others if v is not position_ids), None)
    if position_ids is None and len(others) == 2:  # dims not named alike: fall back to exporters' names
        position_ids = next((v for v in others if "position" in (v.name or "")), None)
        attention_mask = next((v for v in others if v is not position_ids), None)
    rest = [v for v in graph.outputs if v not in cache_outputs]
    logits = [v for v in rest if len(_dims(v)) == 3]
    if len(logits) != 1:
        raise InputError(f"expected one logits output [batch, seq, vocab] besides the KV cache, found {len(logits)}")
    return SourceIO(input_ids, attention_mask, position_ids, logits[0])
