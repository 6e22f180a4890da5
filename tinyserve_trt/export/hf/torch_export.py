"""Export a Hugging Face causal LM to ONNX with explicit KV-cache I/O.

Every style writes the same interface (names and named dims):

    inputs   input_ids                    int64 [batch, sequence_length]
             attention_mask               int64 [batch, total_sequence_length]
             position_ids                 int64 [batch, sequence_length]
             past_key_values.{i}.key      fp32  [batch, kv_heads, past_sequence_length, head_dim]
             past_key_values.{i}.value    (same)
    outputs  logits                       fp32  [batch, sequence_length, vocab]
             present.{i}.key              fp32  [batch, kv_heads, total_sequence_length, head_dim]
             present.{i}.value            (same)

with ``total_sequence_length = past_sequence_length + sequence_length``.
The styles differ only in which torch exporter and attention implementation
trace the model, i.e. in the node pattern of the attention block (see
docs/export_patterns.md):

    dynamo20      torch.onnx.export(dynamo=True),  opset 20, sdpa
    dynamo23      torch.onnx.export(dynamo=True),  opset 23, sdpa (ONNX Attention, RotaryEmbedding)
    legacy_eager  torch.onnx.export(dynamo=False), opset 17, eager
    legacy_sdpa   torch.onnx.export(dynamo=False), opset 17, sdpa

torch and transformers are imported inside functions.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

BATCH, SEQ, PAST, TOTAL = "batch", "sequence_length", "past_sequence_length", "total_sequence_length"


@dataclass(frozen=True)
class ExportStyle:
    """How one fixture is traced: exporter, opset and HF attention implementation."""

    name: str
    dynamo: bool
    opset: int
    attn_implementation: str

    def __post_init__(self) -> None:
        if self.attn_implementation not in ("eager", "sdpa"):
            raise ValueError(f"attn_implementation must be 'eager' or 'sdpa', got {self.attn_implementation!r}")
        if not self.dynamo and self.opset > 20:
            raise ValueError(f"the legacy exporter supports opset <= 20, got {self.opset}")


EXPORT_STYLES: dict[str, ExportStyle] = {
    s.name: s
    for s in (
        ExportStyle("dynamo20", dynamo=True, opset=20, attn_implementation="sdpa"),
        ExportStyle("dynamo23", dynamo=True, opset=23, attn_implementation="sdpa"),
        ExportStyle("legacy_eager", dynamo=False, opset=17, attn_implementation="eager"),
        ExportStyle("legacy_sdpa", dynamo=False, opset=17, attn_implementation="sdpa"),
    )
}


def get_style(style: str | ExportStyle) -> ExportStyle:
    if isinstance(style, ExportStyle):
        return style
    if style not in EXPORT_STYLES:
        raise ValueError(f"unknown export style {style!r}; choose one of {sorted(EXPORT_STYLES)}")
    return EXPORT_STYLES[style]


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """(input names, output names) in graph order."""
    inputs = ["input_ids", "attention_mask", "position_ids"]
    outputs = ["logits"]
    for i in range(num_layers):
        inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outputs += [f"present.{i}.key", f"present.{i}.value"]
    return inputs, outputs


def cache_geometry(config) -> tuple[int, int, int]:
    """(num_layers, kv_heads, head_dim) of a transformers decoder config."""
    config = config.get_text_config(decoder=True)
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, kv_heads, head_dim


def make_wrapper(model):
    """A ``torch.nn.Module`` whose forward takes flat tensors and returns a flat tuple.

    ``forward(input_ids, attention_mask, position_ids, *past)`` with ``past`` =
    (key0, value0, key1, value1, ...) builds a transformers ``DynamicCache``,
    runs the model once, and returns (logits, present key0, value0, ...).
    The presents are the full concatenated caches (past + new tokens).
    """
    import inspect

    import torch
    from transformers import DynamicCache

    # transformers 5.2x renamed `past_key_values` to `cache` (old name deprecated).
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    class KVCacheWrapper(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, attention_mask, position_ids, *past):
            pairs = [(past[i], past[i + 1]) for i in range(0, len(past), 2)]
            cache = DynamicCache(pairs, config=self.lm.config)
            out = self.lm(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                return_dict=True,
                **{cache_kw: cache},
            )
            flat = [out.logits]
            for layer in getattr(out, cache_kw).layers:
                flat += [layer.keys, layer.values]
            return tuple(flat)

    return KVCacheWrapper(model).eval()


def example_inputs(config, batch: int = 2, seq: int = 3, past: int = 5, seed: int = 0, dtype=None):
    """Flat tracing inputs. Sizes are distinct and > 1 so no exporter
    specialises a dynamic dim to a constant or unifies two of them. The past K/V are in
    ``dtype`` (the model's: an fp16 / bf16 model keeps its cache in its own dtype)."""
    import torch

    layers, kv_heads, head_dim = cache_geometry(config)
    gen = torch.Generator().manual_seed(seed)
    vocab = config.get_text_config(decoder=True).vocab_size
    flat = [
        torch.randint(0, vocab, (batch, seq), generator=gen),
        torch.ones(batch, past + seq, dtype=torch.int64),
        torch.arange(past, past + seq).unsqueeze(0).expand(batch, seq).contiguous(),
    ]
    for _ in range(2 * layers):
        flat.append(torch.randn(batch, kv_heads, past, head_dim, generator=gen).to(dtype or torch.float32))
    return tuple(flat)


def _dynamic_axes(num_layers: int) -> dict[str, dict[int, str]]:
    axes = {"input_ids": {0: BATCH, 1: SEQ}, "attention_mask": {0: BATCH, 1: TOTAL},
            "position_ids": {0: BATCH, 1: SEQ}, "logits": {0: BATCH, 1: SEQ}}
    for i in range(num_layers):
        for kind in ("key", "value"):
            axes[f"past_key_values.{i}.{kind}"] = {0: BATCH, 2: PAST}
            axes[f"present.{i}.{kind}"] = {0: BATCH, 2: TOTAL}
    return axes


def _dynamic_shapes(num_layers: int):
    """torch.export dynamic shapes for the flat wrapper signature. DYNAMIC (not
    named Dims) lets torch.export infer total = past + seq by itself."""
    from torch.export import Dim

    d = Dim.DYNAMIC
    past = tuple({0: d, 2: d} for _ in range(2 * num_layers))
    return ({0: d, 1: d}, {0: d, 1: d}, {0: d, 1: d}, past)


def export_causal_lm(model, out_path: str | Path, style: str | ExportStyle) -> Path:
    """Export ``model`` (a transformers ``*ForCausalLM``) to ``out_path``.

    The model's attention implementation is switched to the style's one for
    the duration of the export. Weights larger than 2 GB are not handled
    specially; callers exporting big models should pass a path whose
    directory may hold external data (the legacy exporter is used as is).
    Returns the path written.
    """
    import torch

    style = get_style(style)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    model.set_attn_implementation(style.attn_implementation)
    layers, _, _ = cache_geometry(model.config)
    inputs, outputs = io_names(layers)
    wrapper = make_wrapper(model)
    args = example_inputs(model.config, dtype=next(model.parameters()).dtype)
    with torch.no_grad(), warnings.catch_warnings():
        # The tracer warns about every Python branch on a tensor (cache empty?
        # mask padded?); they are all taken the same way for any past > 0, and
        # the parity tests cover prefill with past = 0.
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
        # Negative indices never reach the padding-mask gather (arange-based).
        warnings.filterwarnings("ignore", message="Exporting aten::index operator", category=UserWarning)
        if style.dynamo:
            program = torch.onnx.export(
                wrapper, args, dynamo=True, opset_version=style.opset,
                input_names=inputs, output_names=outputs,
                dynamic_shapes=_dynamic_shapes(layers), report=False, verbose=False,
            )
            program.save(str(out_path))
        else:
            torch.onnx.export(
                wrapper, args, str(out_path), dynamo=False, opset_version=style.opset,
                input_names=inputs, output_names=outputs, dynamic_axes=_dynamic_axes(layers),
                do_constant_folding=True,
            )
    _name_dims(out_path, layers)
    return out_path


def _name_dims(path: Path, num_layers: int) -> None:
    """Rename the exporter's symbolic dims (``s0``, ``s43 + s72``, ``Addtotal...``)
    to the interface names everywhere in the graph, so rules can compare
    dims symbolically across exporters."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    wanted = {}
    for value in list(graph.input) + list(graph.output):
        for axis, name in _dynamic_axes(num_layers).get(value.name, {}).items():
            dim = value.type.tensor_type.shape.dim[axis]
            if dim.dim_param and dim.dim_param != name:
                wanted.setdefault(dim.dim_param, name)
    if not wanted:
        return
    pattern = re.compile("|".join(sorted((re.escape(k) for k in wanted), key=len, reverse=True)))

    def rename(values):
        for value in values:
            if not value.type.HasField("tensor_type"):
                continue
            for dim in value.type.tensor_type.shape.dim:
                if dim.dim_param in wanted:
                    dim.dim_param = wanted[dim.dim_param]
                elif dim.dim_param:
                    dim.dim_param = pattern.sub(lambda m: wanted[m.group(0)], dim.dim_param)

    rename(graph.input)
    rename(graph.output)
    rename(graph.value_info)
    onnx.save(model, str(path))
