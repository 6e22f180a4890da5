"""Attention decomposed as MatMul -> [scale] -> [mask] -> Softmax -> MatMul.

Two rules share the matcher and differ in where the scale sits:
- ``eager``: ``MatMul(q, K^T) * s + mask`` (legacy eager exports),
- ``sdpa``: ``MatMul(q * sqrt(s), K^T * sqrt(s))`` with a ``Where`` or additive
  mask and an ``IsNaN`` guard (torch SDPA decomposed by dynamo opset 20, the
  legacy exporter and optimum; optimum's GPT-2 computes ``s`` from shapes).
K and V reach the MatMuls from the cache Concat through layout ops only
(the GQA repeat Unsqueeze/Expand/Reshape, transposes).
"""

from __future__ import annotations

import onnx_ir as ir

from ..graph_walk import LAYOUT_OPS, ancestors, as_cache_concat, consumers, is_scalar_like, walk_up
from .base import AttentionMatch, AttentionRule, MaskUse, Refusal, register

_POST_SOFTMAX_PASSTHROUGH = ("Cast", "Dropout", "Identity", "Reshape")


def _has_matmul_ancestor(value: ir.Value) -> bool:
    return any(n.op_type in ("MatMul", "Gemm") for n in ancestors(value, limit=4000, data_only=True))


def _forward_to_value_matmul(softmax: ir.Node) -> ir.Node | None:
    """Follow the probabilities through Cast / IsNaN-guard to the MatMul with V."""
    v = softmax.outputs[0]
    for _ in range(8):
        users = consumers(v)
        ops = sorted(u.op_type for u in users)
        if len(users) == 1 and users[0].op_type == "MatMul" and users[0].inputs[0] is v:
            return users[0]
        if len(users) == 1 and users[0].op_type in _POST_SOFTMAX_PASSTHROUGH:
            v = users[0].outputs[0]
            continue
        if ops == ["IsNaN", "Where"]:  # Where(IsNaN(p), 0, p): SDPA's guard for fully masked rows
            v = next(u for u in users if u.op_type == "Where").outputs[0]
            continue
        return None
    return None


def match_softmax_core(softmax: ir.Node, rule: str) -> tuple[AttentionMatch, bool] | None:
    """The core around ``softmax`` and whether the scale sits on q/K (SDPA) rather than the logits."""
    if softmax.attributes.get_int("axis", -1) not in (-1, 3):
        return None
    pv = _forward_to_value_matmul(softmax)
    if pv is None:
        return None
    factors, masks = [], []
    x = softmax.inputs[0]
    qk = None
    for _ in range(16):
        node = x.producer()
        if node is None:
            return None
        if node.op_type == "MatMul":
            qk = node
            break
        if node.op_type == "Add":
            a, b = node.inputs
            logits, bias = (a, b) if _has_matmul_ancestor(a) else (b, a)
            if _has_matmul_ancestor(bias):
                raise Refusal(node, "an additive attention bias computed from activations (not a mask)")
            masks.append(MaskUse("add", bias, node))
            x = logits
        elif node.op_type == "Where":
            cond, t, f = node.inputs
            keep_true = _has_matmul_ancestor(t)
            masks.append(MaskUse("where", cond, node, keep_when=keep_true))
            x = t if keep_true else f
        elif node.op_type in ("Mul", "Div") and is_scalar_like(node.inputs[1]):
            factors.append((node, node.inputs[1], node.op_type == "Div"))
            x = node.inputs[0]
        elif node.op_type == "Mul" and is_scalar_like(node.inputs[0]):
            factors.append((node, node.inputs[0], False))
            x = node.inputs[1]
        elif node.op_type == "Tanh":
            raise Refusal(node, "logit soft-capping (Tanh before Softmax) is not implemented by the op")
        elif node.op_type in ("Cast", "Reshape"):  # Reshape: bmm-style exports (Bloom) go 3-D and back
            x = node.inputs[0]
        else:
            raise Refusal(node, f"{node.op_type} between the attention logits and Softmax is not supported")
    if qk is None:
        return None

    def is_cache(v):
        return as_cache_concat(v, None) is not None

    k_chain, blocked = walk_up(qk.inputs[1], is_cache)
    if k_chain is None:
        if blocked is not None and blocked.op_type not in LAYOUT_OPS:
            raise Refusal(blocked, f"keys reach the attention through {blocked.op_type}; only layout ops "
                                   "(GQA repeat, transpose) may sit between the KV cache and the MatMul")
        return None  # not a self-attention over a KV cache (e.g. no cache input)
    v_chain, blocked = walk_up(pv.inputs[1], is_cache, allow_scale=False)
    if v_chain is None:
        if blocked is not None:
            raise Refusal(blocked, f"values reach the attention through {blocked.op_type}")
        return None
    q_chain, _ = walk_up(qk.inputs[0], lambda v: v.producer() is None or not (
        v.producer().op_type in ("Mul", "Div") and any(is_scalar_like(i) for i in v.producer().inputs)))
    query = q_chain.source if q_chain is not None else qk.inputs[0]
    operand_factors = (q_chain.factors if q_chain else []) + k_chain.factors
    match = AttentionMatch(rule, softmax, query, as_cache_concat(k_chain.source, None),
                           as_cache_concat(v_chain.source, None), pv.outputs[0], factors + operand_factors,
                           masks=masks)
    match.chain_values = [n.outputs[0] for n in k_chain.nodes + v_chain.nodes]
    return match, bool(operand_factors)


@register
class SdpaRule(AttentionRule):
    """Decomposed SDPA: the scale is split over q and K (sqrt(s) each)."""

    name = "sdpa"
    anchor_ops = ("Softmax",)

    def pattern(self, node, graph):
        found = match_softmax_core(node, self.name)
        return found[0] if found is not None and found[1] else None


@register
class EagerRule(AttentionRule):
    """Eager attention: the scale multiplies the logits after MatMul(q, K^T)."""

    name = "eager"
    anchor_ops = ("Softmax",)

    def pattern(self, node, graph):
        found = match_softmax_core(node, self.name)
        return found[0] if found is not None and not found[1] else None
