"""The QueryAwareSparseAttention op: schema (single source), reference, ONNX function."""

from . import schema
from .policies import get_policy, registered, select_pages
from .reference import sparse_attention_ref

__all__ = ["schema", "get_policy", "registered", "select_pages", "sparse_attention_ref"]
