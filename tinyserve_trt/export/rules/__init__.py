"""Attention rewrite rules (one module per attention shape), registered on import."""

from . import onnx_attention, softmax_core  # noqa: F401  (registration)
from .base import AttentionMatch, AttentionRule, MaskUse, Refusal, rules

__all__ = ["AttentionMatch", "AttentionRule", "MaskUse", "Refusal", "rules"]
