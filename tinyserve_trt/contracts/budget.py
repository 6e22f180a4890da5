"""A decode step's token budget: a floor, and a share of the context above it.

``max(tokens, floor(share * context))`` cached tokens per step (``share`` 0: the fixed budget
``tokens``; ``tokens`` 0: dense). A package's default (``tinyserve.json``: ``token_budget``,
``budget_share``) is this rule; the scheduler applies it to every decode row (``runtime/batch.py``),
the export summary prints it, ``tinyserve eval`` evaluates it. A fixed budget read 1/8 of an 8K
context but 1/32 of 32K: on Qwen2.5-0.5B per-head selection at 1024 tokens cost 0.3-1.3% perplexity
at 8K but 4.2% at 16K on KJV, at 2048 (1/8) 1.5% (benchmarks/results/long_context.md, session 18).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeBudget:
    tokens: int = 0  # the floor (0 = dense)
    share: float = 0.0  # of the context, in [0, 1]

    def __post_init__(self):
        if not isinstance(self.tokens, int) or isinstance(self.tokens, bool) or self.tokens < 0:
            raise ValueError(f"token_budget must be an int >= 0 (0 = dense), got {self.tokens!r}")
        if not isinstance(self.share, (int, float)) or isinstance(self.share, bool) or not 0.0 <= self.share <= 1.0:
            raise ValueError(f"budget_share must be a number in [0, 1] (0: a fixed budget), got {self.share!r}")

    def at(self, context: int) -> int:
        """The budget of a step whose row attends ``context`` tokens (cached + new)."""
        if self.tokens == 0:
            return 0
        return max(self.tokens, int(self.share * context))

    def describe(self) -> str:
        if self.tokens == 0:
            return "dense"
        if self.share == 0:
            return f"{self.tokens} tokens"
        return f"{self.share:g} of the context, at least {self.tokens} tokens"
