"""Teacher-forced perplexity of a text's last positions, dense and at each token budget, through the runtime.

The first ``len(ids) - eval_tokens - 1`` tokens are the prompt: prefilled densely once (as serving
does; the other budgets' requests reuse its pages through the prefix cache). The last
``eval_tokens`` positions are decode steps - where the op selects pages - each fed the text's
token and scored on the next one, all budgets decoding side by side in one batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tinyserve_trt.runtime.eval.forcing import TeacherForcing
from tinyserve_trt.runtime.eval.steps import run_requests
from tinyserve_trt.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class PerplexityRow:
    budget: int  # 0 = dense
    nll: float  # mean negative log-likelihood per scored token
    tokens: int

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


def perplexity(engine, ids: list[int], eval_tokens: int, budgets, progress=None) -> list[PerplexityRow]:
    """Dense first, then one row per budget in ``budgets`` (0 = dense, listed once)."""
    if eval_tokens < 1:
        raise ValueError(f"eval_tokens must be >= 1, got {eval_tokens}")
    if len(ids) < eval_tokens + 2:
        raise ValueError(f"the text has {len(ids)} tokens; scoring {eval_tokens} needs at least {eval_tokens + 2}")
    prompt, forced = list(ids[:-eval_tokens - 1]), list(ids[-eval_tokens - 1:])
    modes = [0] + [b for b in dict.fromkeys(int(b) for b in budgets) if b != 0]
    forcing = TeacherForcing(engine)
    try:
        requests = {}
        for b in modes:
            rid = f"ppl-{b}"
            forcing.force(rid, forced)
            requests[rid] = (prompt, SamplingParams(temperature=0, max_tokens=len(forced), ignore_eos=True,
                                                    token_budget=b))
        run_requests(engine, requests, progress)
        rows = []
        for b in modes:
            lp = forcing.logprobs[f"ppl-{b}"][1:]  # [0]: predicted by the prefill, dense for every budget
            rows.append(PerplexityRow(b, -sum(lp) / len(lp), len(lp)))
        return rows
    finally:
        forcing.close()
