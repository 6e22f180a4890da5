"""What a request gives back, and the tracker that builds it from its sequences.

``RequestTracker`` follows one request's sequences (``n`` samples), turns new
tokens into text with the package's tokenizer, applies stop strings (the
engine works on token ids only) and snapshots a ``RequestOutput``. Shared by
``LLM`` and ``AsyncLLM``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tinyserve_trt.runtime.sequence import Sequence


@dataclass
class RequestStats:
    """Per-request figures (seconds; the scheduler's monotonic clock).

    ttft:                     arrival to first token.
    tokens_per_s:             decode rate after the first token (None with one token).
    prefix_pages_reused:      KV pages matched in the prefix cache at admission.
    pages_selected_per_step:  mean pages attended per decode step, KV head and sparse layer.
    """

    prompt_tokens: int
    output_tokens: int
    ttft: float | None
    latency: float | None
    tokens_per_s: float | None
    prefix_pages_reused: int
    prefix_tokens_reused: int
    pages_selected_per_step: float | None
    num_preemptions: int

    @classmethod
    def of(cls, seq: Sequence) -> RequestStats:
        s = seq.stats
        end = s.finish_time
        rate = None
        if end is not None and s.first_token_time is not None and seq.num_output_tokens > 1 \
                and end > s.first_token_time:
            rate = (seq.num_output_tokens - 1) / (end - s.first_token_time)
        return cls(seq.num_prompt_tokens, seq.num_output_tokens, s.ttft,
                   None if end is None else end - s.arrival_time, rate, s.prefix_pages_reused,
                   s.prefix_tokens_reused, float(np.mean(s.pages_selected)) if s.pages_selected else None,
                   s.num_preemptions)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class CompletionOutput:
    """One sample of a request: generated tokens only (not the prompt).

    delta_token_ids / delta_text: what is new since the previous snapshot (streaming).
    logprobs / top_logprobs: per generated token, its logprob and the ``k`` most likely
    ``(token_id, logprob)`` (k = ``SamplingParams.logprobs``), under the raw model
    distribution; None unless requested.
    """

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] | None = None
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    stats: RequestStats | None = None


class RequestTracker:
    """Text and stop strings for one request's sequences.

    ``tokenizer``: an object with ``decode(ids) -> str`` (ModelPackage), or None
    (text stays ""; stop strings then cannot match). Streamed text is held back
    while it could be the start of a stop string.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params, tokenizer=None):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, list(prompt_token_ids)
        self.params, self.tokenizer = params, tokenizer
        self.seqs: dict[int, Sequence] = {}
        self._text: dict[int, str] = {}
        self._stopped: dict[int, int] = {}  # index -> output tokens kept when a stop string matched
        self._sent_tokens: dict[int, int] = {}
        self._sent_text: dict[int, int] = {}
        self._hold = max((len(s) for s in params.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None and ids else ""

    def update(self, seq: Sequence) -> bool:
        """Note ``seq``'s new token; True when a stop string ended it (the caller finishes it)."""
        self.seqs[seq.index] = seq
        if not self.params.stop or self.tokenizer is None or seq.index in self._stopped:
            return False
        out = seq.output_token_ids
        tail = self._decode(out[-(self._hold + 8):])
        if not any(s in tail for s in self.params.stop):
            return False
        text = self._decode(out)
        cut = min(i for i in (text.find(s) for s in self.params.stop) if i >= 0)
        self._text[seq.index] = text[:cut]
        self._stopped[seq.index] = len(out)
        return True

    @property
    def finished(self) -> bool:
        return bool(self.seqs) and len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs.values())

    def snapshot(self, text: bool = True) -> RequestOutput:
        """The request so far; deltas are relative to the previous snapshot."""
        outs = []
        for index in sorted(self.seqs):
            seq = self.seqs[index]
            ids = seq.output_token_ids[:self._stopped.get(index, seq.num_output_tokens)]
            if index in self._stopped:
                full = self._text[index]
            elif text:
                full = self._decode(ids)
                if not seq.is_finished:  # hold back a possible stop-string prefix and partial characters
                    full = full[:len(full) - self._hold] if self._hold else full
                    full = full.rstrip("\ufffd")
            else:
                full = ""
            sent_t, sent_c = self._sent_tokens.get(index, 0), self._sent_text.get(index, 0)
            self._sent_tokens[index], self._sent_text[index] = len(ids), max(sent_c, len(full))
            reason = seq.finish_reason.value if seq.finish_reason is not None else None
            want = seq.params.logprobs is not None
            logprobs = seq.output_logprobs[:len(ids)] if want else None
            tops = seq.output_top_logprobs[:len(ids)] if want else None
            outs.append(CompletionOutput(index, list(ids), full, reason, logprobs, list(ids[sent_t:]),
                                         full[sent_c:], tops))
        stats = RequestStats.of(self.seqs[0]) if 0 in self.seqs else None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished, stats)
