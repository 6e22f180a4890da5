"""Two-level page selection (``sub_page_size`` > 0): the numpy definition of the rule.

Level 1 ranks a sequence's physical pages by their coarse score and keeps
``max(floor(candidate_share * n), budget // ps, #forced)`` candidates (forced
pages included). Level 2 re-ranks the candidates' sub-pages of ``sp`` tokens
by the same bound computed from their own (compact) min/max and keeps the
forced pages' written sub-pages plus the best other candidate sub-pages, up to
``max(budget // sp, #forced sub-pages)`` sub-pages in all. A budget <= 0, or one
that covers every written sub-page, is dense. The reference
(``ops/reference.py``) and the ONNX body (``ops/function.py``) implement this;
``tests/evaluation`` pins the evaluation's torch copy to it. LServe
(arXiv 2502.14866) scores small logical pages inside large physical pages the
same way. Does not modify its inputs.
"""

from __future__ import annotations

import numpy as np

from .policies import select_pages


def candidate_pages(n: int, budget: int, page_size: int, candidate_share: float) -> int:
    """Candidate pages of a sequence with ``n`` pages, before the forced pages are counted in.
    The share is a float32 attribute; the product rounds in float32, as in the ONNX body."""
    return max(int(np.floor(np.float32(candidate_share) * np.float32(n))), budget // page_size)


def select_sub_pages(coarse: np.ndarray, fine: np.ndarray, past_len: int, budget: int, page_size: int,
                     sub_page_size: int, candidate_share: float, sink_pages: int, recent_pages: int) -> np.ndarray:
    """Kept sub-pages ``[n * r]`` (bool) of one sequence and KV head.

    coarse: ``[n]`` page scores; fine: ``[n * r]`` sub-page scores (only the
    candidates' are read); ``past_len`` cached tokens, ``n = ceil(past_len / ps)``.
    Sub-pages past ``past_len`` are never kept.
    """
    ps, sp = page_size, sub_page_size
    if sp < 1 or ps % sp:
        raise ValueError(f"sub_page_size {sp} must divide the page size {ps}")
    r = ps // sp
    n = coarse.shape[0]
    if fine.shape[0] != n * r:
        raise ValueError(f"fine scores have {fine.shape[0]} entries, expected {n} pages x {r} sub-pages")
    written = np.arange(n * r) < -(-past_len // sp)
    idx = np.arange(n)
    forced = np.repeat((idx < sink_pages) | (idx >= n - recent_pages), r) & written
    keep_n = max(budget // sp, int(forced.sum()))
    if budget <= 0 or keep_n >= int(written.sum()):
        return written
    cand_tokens = max(candidate_pages(n, budget, ps, candidate_share) * ps, budget)  # > 0; forced pages added
    cand = np.repeat(select_pages(coarse, cand_tokens, ps, sink_pages, recent_pages), r) & written & ~forced
    keep = forced.copy()
    rest = np.flatnonzero(cand)
    order = rest[np.argsort(-fine[rest], kind="stable")]
    keep[order[: keep_n - int(forced.sum())]] = True
    return keep
