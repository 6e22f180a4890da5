"""The ONNX ``Attention`` op (opset 23), as torch's dynamo exporter emits it.

``Attention(Q [B,H,S,D], K, V, attn_mask)`` where K and V are the cache
Concat outputs behind the GQA repeat. Soft-capping (``softcap``) is refused;
the explicit ``scale`` attribute (0: default 1/sqrt(D)) is kept.
"""

from __future__ import annotations

from ..graph_walk import as_cache_concat, consumers, walk_up
from .base import AttentionMatch, AttentionRule, MaskUse, Refusal, register


@register
class OnnxAttentionRule(AttentionRule):
    name = "onnx_attention"
    anchor_ops = ("Attention",)

    def pattern(self, node, graph):
        if node.domain not in ("", "ai.onnx"):
            return None
        ins = list(node.inputs) + [None] * (6 - len(node.inputs))
        q, k, v, mask, past_k, past_v = ins[:6]
        if past_k is not None or past_v is not None:
            raise Refusal(node, "Attention with its own past_key/past_value inputs (cache inside the op)")
        if any(consumers(o) or o.is_graph_output() for o in node.outputs[1:]):
            raise Refusal(node, "Attention's present/qk outputs are used; only the attention output may be")
        if (node.attributes.get_float("softcap", 0.0) or 0.0) != 0.0:
            raise Refusal(node, "logit soft-capping (softcap attribute) is not implemented by the op")
        if q is None or len(q.shape or ()) not in (0, 4):
            raise Refusal(node, "Attention with 3-D (packed-head) inputs is not supported")

        def is_cache(x):
            return as_cache_concat(x, None) is not None

        k_chain, blocked_k = walk_up(k, is_cache, allow_scale=False)
        v_chain, blocked_v = walk_up(v, is_cache, allow_scale=False)
        if k_chain is None or v_chain is None:
            blocked = blocked_k or blocked_v
            if blocked is not None:
                raise Refusal(blocked, f"K/V reach the Attention op through {blocked.op_type}")
            return None
        masks = []
        if mask is not None:
            masks.append(MaskUse("bool" if mask.dtype is not None and mask.dtype.name == "BOOL" else "add",
                                 mask, node))
        scale = node.attributes.get_float("scale", 0.0) or 0.0
        match = AttentionMatch(self.name, node, q, as_cache_concat(k_chain.source, None),
                              as_cache_concat(v_chain.source, None), node.outputs[0],
                              fixed_scale=scale if scale > 0 else None, masks=masks,
                               causal_attr=bool(node.attributes.get_int("is_causal", 0)))
        match.chain_values = [n.outputs[0] for n in k_chain.nodes + v_chain.nodes]
        return match
