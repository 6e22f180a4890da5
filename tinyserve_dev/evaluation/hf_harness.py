"""Run a Hugging Face decoder with the op's decode-mode attention, all positions at once.

``SparseAttentionHarness`` is an attention function in the transformers
``AttentionInterface`` signature. Positions before ``decode_from`` are a
prefill (exact causal attention, as the op does for ``S > 1``); positions
from ``decode_from`` on are decode steps (``decode_attention``): each sees
what the op would attend at that step, with the first ``dense_layers``
layers dense, as the exporter configures them. ``use_harness`` installs it on
a model for the duration of a ``with`` block.

Batch 1 only: evaluation runs one text at a time.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch

from tinyserve_trt.contracts.dense_layers import dense_layer_indices

from .decode_attention import DENSE, SelectionSpec, decode_attention

_names = itertools.count()


@dataclass
class SparseAttentionHarness:
    spec: SelectionSpec = DENSE
    dense_layers: int | tuple[int, ...] = 0  # the leading count, or indices (contracts.dense_layers)
    decode_from: int = 0  # absolute position of the first decode step
    chunk: int = 256  # query rows per block: memory ~ heads * chunk * context floats
    probe: object = None  # a recall.RecallProbe fed by every decode row of every layer

    def __post_init__(self):
        dense_layer_indices(self.dense_layers)  # a count or layer indices
        if self.decode_from < 0 or self.chunk < 1:
            raise ValueError("decode_from must be >= 0, chunk >= 1")

    def layer_spec(self, layer: int) -> SelectionSpec:
        return DENSE if layer in dense_layer_indices(self.dense_layers) else self.spec

    def __call__(self, module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, **kwargs):
        """query [1, H, S, D], key/value [1, Hkv, P + S, D] -> ([1, S, H, D], None)."""
        if query.shape[0] != 1:
            raise ValueError(f"the evaluation harness runs batch 1, got {query.shape[0]}")
        _, H, S, D = query.shape
        T = key.shape[2]
        q_start = T - S
        scale = scaling if scaling is not None else D ** -0.5
        split = min(S, max(0, self.decode_from - q_start))  # rows [0, split) are prefill
        out = torch.empty_like(query[0])
        if split:
            kv_end = q_start + split
            # from position 0 the causal flag lets SDPA pick a kernel that never builds the [S, S] mask
            mask = None if q_start == 0 else \
                torch.arange(kv_end)[None, :] <= torch.arange(q_start, kv_end)[:, None]
            out[:, :split] = torch.nn.functional.scaled_dot_product_attention(
                query[:, :, :split], key[:, :, :kv_end], value[:, :, :kv_end], attn_mask=mask,
                is_causal=mask is None, scale=scale, enable_gqa=True)[0]
        if split < S:
            layer = getattr(module, "layer_idx", 0)
            out[:, split:] = decode_attention(query[0, :, split:], key[0], value[0], q_start + split,
                                              self.layer_spec(layer), scale, chunk=self.chunk,
                                              probe=self.probe, layer=layer)
        return out.transpose(0, 1).unsqueeze(0), None


@contextlib.contextmanager
def use_harness(model, harness: SparseAttentionHarness):
    """Make ``model`` attend through ``harness`` inside the block; restores the previous implementation."""
    from transformers import AttentionInterface

    name = f"tinyserve_decode_{next(_names)}"
    AttentionInterface.register(name, harness)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
        AttentionInterface._global_mapping.pop(name, None)
