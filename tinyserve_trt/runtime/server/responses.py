"""OpenAI response bodies and stream chunks, built from RequestOutput snapshots.

One ``Responder`` per HTTP request: ``kind`` is ``"completion"`` (``text_completion``,
``choices[].text``) or ``"chat"`` (``chat.completion`` / ``chat.completion.chunk``,
``choices[].message`` / ``choices[].delta``). Choice ``index`` = prompt index * n +
sample index. Logprobs are those of the raw model distribution (before temperature,
top-k/top-p), as OpenAI reports them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from tinyserve_trt.runtime.outputs import CompletionOutput


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Responder:
    """Builds the JSON of one request's answer. ``token_text(id) -> str`` spells a token."""

    def __init__(self, kind: str, model: str, token_text: Callable[[int], str], want_logprobs: bool):
        if kind not in ("completion", "chat"):
            raise ValueError(f"kind must be 'completion' or 'chat', got {kind!r}")
        self.kind, self.model, self.token_text, self.want_logprobs = kind, model, token_text, want_logprobs
        self.id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # choice index -> characters streamed (completion text_offset)

    # ---- whole responses --------------------------------------------------------
    def choice(self, index: int, out: CompletionOutput) -> dict:
        lp = self._logprobs(index, out.token_ids, out.logprobs, out.top_logprobs, 0)
        if self.kind == "completion":
            return {"index": index, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason}
        return {"index": index, "message": {"role": "assistant", "content": out.text},
                "logprobs": lp, "finish_reason": out.finish_reason}

    def body(self, choices: list[dict], use: dict) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": sorted(choices, key=lambda c: c["index"]), "usage": use}

    # ---- stream chunks -----------------------------------------------------------
    def role_chunk(self, index: int) -> dict:
        """Chat streams open each choice with ``delta: {"role": "assistant", "content": ""}``."""
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def delta_chunk(self, index: int, out: CompletionOutput, finish_reason: str | None) -> dict:
        """The new text (and its tokens' logprobs) of one choice since the previous chunk."""
        k = len(out.delta_token_ids)
        lp = None
        if self.want_logprobs and out.logprobs is not None and k:
            base = self._offsets.get(index, 0)
            lp = self._logprobs(index, out.delta_token_ids, out.logprobs[-k:],
                                out.top_logprobs[-k:] if out.top_logprobs else None, base)
        self._offsets[index] = self._offsets.get(index, 0) + len(out.delta_text)
        if self.kind == "completion":
            choice = {"index": index, "text": out.delta_text, "logprobs": lp, "finish_reason": finish_reason}
        else:
            delta = {"content": out.delta_text} if out.delta_text or finish_reason is None else {}
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        return self._chunk(choice)

    def usage_chunk(self, use: dict) -> dict:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        chunk = self._chunk(None)
        chunk["choices"], chunk["usage"] = [], use
        return chunk

    def _chunk(self, choice: dict | None) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [] if choice is None else [choice]}

    # ---- logprobs --------------------------------------------------------------------
    def _logprobs(self, index: int, ids: list[int], lps: list[float] | None, tops, base: int) -> dict | None:
        if not self.want_logprobs or lps is None:
            return None
        tops = tops or [[] for _ in ids]
        spell = self.token_text
        if self.kind == "completion":
            tokens = [spell(t) for t in ids]
            offsets, at = [], base
            for tok in tokens:
                offsets.append(at)
                at += len(tok)
            return {"tokens": tokens, "token_logprobs": list(lps),
                    "top_logprobs": [{spell(t): lp for t, lp in top} for top in tops], "text_offset": offsets}

        def entry(t: int, lp: float) -> dict:
            s = spell(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return {"content": [dict(entry(t, lp), top_logprobs=[entry(a, b) for a, b in top])
                            for t, lp, top in zip(ids, lps, tops)]}
