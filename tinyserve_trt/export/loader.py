"""Load and sanity-check the user's ONNX export; find its attention blocks."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import onnx
import onnx_ir as ir
from onnx_ir.external_data import set_base_dir

from .errors import InputError, UnsupportedError
from . import bf16
from .proto_scan import load_proto
from .weights import check_copy, check_external_data, external_files, inline_small
from .graph_walk import as_cache_concat, is_past_input
from .rules import AttentionMatch, rules


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of the model file followed by the external data files it names (one ``.data``
    file or one per tensor), so a change of weights changes it."""
    path = Path(path)
    h = hashlib.sha256()
    proto = load_proto(path)  # an inline model's weights are in the model file itself
    for p in dict.fromkeys([path] + [path.parent / loc for loc in external_files(proto)]):
        with open(p, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
    return h.hexdigest()


def load_source(path: str | Path, scratch: Path | None = None) -> tuple[ir.Model, Path]:
    """(the model as onnx_ir, the file sessions of the source load): its large weights left in
    their files (lazy ``ExternalTensor``s: any size, ``weights.py``); InputError for a missing,
    non-ONNX or truncated file. A model whose large weights are inline (one file under 2 GB) is
    read without them (``proto_scan.py``): they stay in the model file as external references, so
    no stage holds them in memory. A bfloat16 model is widened to float32 into ``scratch``
    (``bf16.py``), and that widened file is the one sessions load."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if not path.is_file():
        raise InputError(f"{path}: not a file")
    try:
        proto = load_proto(path)  # inline weights stay in the file (proto_scan.py)
    except Exception as e:  # protobuf DecodeError, truncated reads, ...
        raise InputError(f"{path}: not a readable ONNX model ({type(e).__name__}: {str(e)[:120]})") from None
    if not proto.graph.node:
        raise InputError(f"{path}: not an ONNX model (no graph nodes)")
    _refuse_fused_attention(proto)
    check_external_data(proto, path.parent, str(path))
    inline_small(proto, path.parent)
    base, reference = path.parent, path
    if bf16.is_bf16(proto):
        if scratch is None:
            raise UnsupportedError(f"bfloat16 model ({path}): ONNX Runtime's CPU EP has no bf16 kernels; "
                                   "export it in fp16 or fp32")
        reference, base = bf16.upcast(proto, path.parent, Path(scratch)), Path(scratch)
    try:  # after the move: check_copy copies what is still inline
        onnx.checker.check_model(check_copy(proto))
    except onnx.checker.ValidationError as e:
        raise InputError(f"{path}: invalid ONNX model ({str(e).splitlines()[0][:160]})") from None
    model = ir.from_proto(proto)
    del proto
    set_base_dir(model.graph, str(base))
    return model, reference


# Fused attention ops of ONNX Runtime's contrib domain (what onnxruntime_genai.models.builder and
# ORT's transformer optimizer write): they own the KV cache (and GQA its rotary), so there is no
# cache concat + softmax core for a rule to rewrite.
FUSED_ATTENTION = {("com.microsoft", "GroupQueryAttention"), ("com.microsoft", "MultiHeadAttention"),
                   ("com.microsoft", "Attention"), ("com.microsoft", "PagedAttention"),
                   ("com.microsoft", "SparseAttention"), ("com.microsoft", "DecoderMaskedMultiHeadAttention")}


def _refuse_fused_attention(proto: onnx.ModelProto) -> None:
    """UnsupportedError naming the first fused contrib attention node (before the checker, which
    would call such a model invalid)."""
    for node in proto.graph.node:
        if (node.domain, node.op_type) in FUSED_ATTENTION:
            raise UnsupportedError(
                f"unsupported attention at node {node.name or '<unnamed>'} ({node.domain}::{node.op_type}): an ONNX "
                "Runtime fused attention that keeps its own KV cache (ORT GenAI's model builder writes these); "
                "give tinyserve-export the Hugging Face folder or GGUF file instead (or a torch.onnx.export of it)")


def _refuse_windowed_cache(g: ir.Graph) -> None:
    """present = Slice(Concat(past..., new)): a cache that keeps only the last W
    tokens, i.e. sliding-window attention, which the op does not implement."""
    for out in g.outputs:
        node = out.producer()
        if node is None or node.op_type != "Slice":
            continue
        src = node.inputs[0].producer()
        if src is not None and src.op_type == "Concat" and any(
                i is not None and _reaches_graph_input(i) for i in src.inputs):
            raise UnsupportedError(f"unsupported attention at node {node.name or '<unnamed>'} (Slice): the KV "
                                   "cache output is a window of the concatenated cache (sliding-window attention)")


def _reaches_graph_input(v: ir.Value, depth: int = 0) -> bool:
    if v.is_graph_input():
        return True
    node = v.producer()
    return node is not None and depth < 4 and node.op_type in ("Slice", "Identity", "Concat") and \
        _reaches_graph_input(node.inputs[0], depth + 1)


def find_attention(model: ir.Model) -> tuple[list[AttentionMatch], Counter]:
    """Every attention block, in graph order, with a count per rule. Refuses
    (with the node's name) a KV cache that no rule accounts for."""
    g = model.graph
    cache_concats = [n for n in g if n.op_type == "Concat" and n.outputs[0].is_graph_output()
                     and len(n.inputs) == 2 and is_past_input(n.inputs[0], g) is not None]
    if not cache_concats:
        _refuse_windowed_cache(g)
        softmaxes = sum(1 for n in g if n.op_type in ("Softmax", "Attention"))
        what = "encoder-only model or exported without KV cache" if softmaxes else "no attention either"
        raise InputError("no KV-cache I/O (past_key_values inputs concatenated into present outputs): " + what)
    matches, counts = [], Counter()
    for node in g:
        for rule in rules():
            if node.op_type in rule.anchor_ops:
                m = rule.pattern(node, g)
                if m is not None:
                    rule.check(m)
                    matches.append(m)
                    counts[rule.name] += 1
                    break
    if not matches:
        raise UnsupportedError(f"no attention block found that reads the KV cache (first cache concat: node "
                               f"{cache_concats[0].name}); the attention is in a form no rule implements")
    used = {m.key.node for m in matches} | {m.value.node for m in matches}
    stray = [n for n in cache_concats if n not in used and as_cache_concat(n.outputs[0], g) is not None]
    if stray:
        raise UnsupportedError(f"KV cache concat at node {stray[0].name} feeds an attention no rule recognises "
                               f"({len(stray)} cache tensors unaccounted for)")
    return matches, counts
