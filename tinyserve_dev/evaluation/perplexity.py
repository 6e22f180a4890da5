"""Perplexity of decode steps after a dense prefill, for many selections of one text.

Serving prefills a prompt exactly and runs selection on decode steps only, so
that is what is measured: ``ids[:eval_from]`` is prefilled once (dense, its
KV cache kept), then every selection runs decode steps at positions
``eval_from .. T-2`` (all at once, through ``SparseAttentionHarness``) and
scores their next-token predictions. Each selection restarts from a copy of
the prefill cache, so runs are independent and share the prefill's cost.
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass

import torch

from .decode_attention import SelectionSpec
from .hf_harness import SparseAttentionHarness, use_harness


def cache_kwarg(model) -> str:
    """The decoder's KV-cache argument: ``cache`` in transformers >= 5.x, ``past_key_values`` before."""
    params = inspect.signature(model.model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass
class NllResult:
    nll: float  # mean negative log-likelihood (nats per token)
    tokens: int

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


class PrefixPerplexity:
    """Dense prefill of ``ids[:eval_from]`` once; ``run(spec)`` scores the rest under ``spec``.

    ids: ``[T]`` token ids (int64). model: a Hugging Face causal LM with
    ``.model`` (the decoder) and ``.lm_head``, in eval mode.
    """

    def __init__(self, model, ids: torch.Tensor, eval_from: int, chunk: int = 256):
        if not 0 < eval_from < ids.numel() - 1:
            raise ValueError(f"eval_from must be in (0, {ids.numel() - 1}), got {eval_from}")
        self.model, self.ids, self.eval_from, self.chunk = model, ids, eval_from, chunk
        self._cache_arg = cache_kwarg(model)
        with torch.no_grad():
            out = model.model(input_ids=ids[None, :eval_from], use_cache=True)
        self._prefill_cache = getattr(out, "past_key_values", None) or getattr(out, "cache")

    @property
    def eval_tokens(self) -> int:
        return self.ids.numel() - 1 - self.eval_from

    def run(self, spec: SelectionSpec, dense_layers: int = 0, probe=None) -> NllResult:
        """Mean NLL of tokens ``eval_from+1 ..`` predicted by decode steps under ``spec``."""
        harness = SparseAttentionHarness(spec, dense_layers=dense_layers, decode_from=self.eval_from,
                                         chunk=self.chunk, probe=probe)
        cache = copy.deepcopy(self._prefill_cache)
        with use_harness(self.model, harness), torch.no_grad():
            hidden = self.model.model(input_ids=self.ids[None, self.eval_from:-1], use_cache=True,
                                      **{self._cache_arg: cache}).last_hidden_state
            logits = self.model.lm_head(hidden)[0]
            nll = torch.nn.functional.cross_entropy(logits.float(), self.ids[self.eval_from + 1:])
        return NllResult(float(nll), logits.shape[0])
