"""Attention rules: an ABC, a registry, and what a match holds.

A rule is declarative: ``pattern`` finds the attention core around an anchor
node (structure only), ``check`` refuses what the op does not implement with a
reason naming the node, and every rule's rewrite is the same op node
(``export/kv_io.py``). The pipeline counts matches per rule.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import onnx_ir as ir

from ..errors import UnsupportedError
from ..graph_walk import CacheConcat


@dataclass
class MaskUse:
    """How the core applies a mask: ``add`` (additive bias), ``where`` (keep the
    logit where ``value == keep_when``) or ``bool`` (an Attention op's bool mask)."""

    kind: str
    value: ir.Value
    node: ir.Node
    keep_when: bool = True


@dataclass
class AttentionMatch:
    """One attention block: ``output [B, H, S, D] = attend(query, K cache, V cache)``."""

    rule: str
    anchor: ir.Node
    query: ir.Value  # [B, H, S, D], before any scale
    key: CacheConcat
    value: CacheConcat
    output: ir.Value  # [B, H, S, D]
    scale_factors: list = field(default_factory=list)  # (node, scalar value, divides)
    fixed_scale: float | None = None  # an explicit scale attribute (Attention op)
    masks: list[MaskUse] = field(default_factory=list)
    causal_attr: bool = False  # Attention(is_causal=1): causality without a mask input
    # K/V values between the cache and the attention (GQA repeat, transposes): an
    # exporter may read shapes off them; the rewrite redirects those Shapes.
    chain_values: list = field(default_factory=list)

    def where(self) -> str:
        return f"node {self.anchor.name or '<unnamed>'} ({self.anchor.op_type})"


class Refusal(UnsupportedError):
    """An attention block whose variant the op does not implement."""

    def __init__(self, node: ir.Node, reason: str):
        super().__init__(f"unsupported attention at node {node.name or '<unnamed>'} ({node.op_type}): {reason}")
        self.node = node


class AttentionRule(ABC):
    name: str = ""
    anchor_ops: tuple[str, ...] = ()

    @abstractmethod
    def pattern(self, node: ir.Node, graph: ir.Graph) -> AttentionMatch | None:
        """The match anchored at ``node``, None if this rule does not apply; raises
        ``Refusal`` for a recognised attention block in an unsupported variant."""

    def check(self, match: AttentionMatch) -> None:
        """Structural checks beyond the pattern (numeric ones use the probe)."""


_RULES: dict[str, AttentionRule] = {}


def register(cls):
    _RULES[cls.name] = cls()
    return cls


def rules() -> list[AttentionRule]:
    return list(_RULES.values())
