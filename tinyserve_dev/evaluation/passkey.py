"""Passkey retrieval: a number hidden at some depth of filler text, asked for at the end.

The prompt is one chat-template user turn: an instruction, filler sentences
with the passkey line at ``depth`` (0 = start, 1 = end), then the question.
Everything before the question is prefilled densely (as serving does); the
question and the answer are decode steps, so the selection decides whether
the model still sees the passkey - as Quest evaluates it. Greedy decoding,
correct when the answer contains the passkey's digits.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import torch

from tinyserve_trt.runtime.eval.passkey import FILLER, INSTRUCTION, NEEDLE, QUESTION  # the one prompt text

from .decode_attention import SelectionSpec
from .hf_harness import SparseAttentionHarness, use_harness
from .perplexity import cache_kwarg


@dataclass(frozen=True)
class PasskeyPrompt:
    prefill_ids: torch.Tensor  # [P] instruction + filler + needle: prefilled densely
    decode_ids: torch.Tensor  # [Q] question + template tail: decode steps
    passkey: str
    depth: float

    @property
    def length(self) -> int:
        return self.prefill_ids.numel() + self.decode_ids.numel()


def build_prompt(tokenizer, context: int, depth: float, passkey: str) -> PasskeyPrompt:
    """A prompt of about ``context`` tokens (within one filler sentence) with the passkey at ``depth``."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")

    def render(n_filler: int) -> tuple[str, int]:
        before = round(n_filler * depth)
        body = INSTRUCTION + FILLER * before + NEEDLE.format(key=passkey) + FILLER * (n_filler - before)
        text = tokenizer.apply_chat_template([{"role": "user", "content": body + QUESTION}], tokenize=False,
                                             add_generation_prompt=True)
        return text, text.index(QUESTION)

    per_filler = len(tokenizer(FILLER * 8)["input_ids"]) / 8
    base = len(tokenizer(render(0)[0])["input_ids"])
    n = max(0, int((context - base) / per_filler))
    while n > 0 and len(tokenizer(render(n)[0])["input_ids"]) > context:
        n -= 1
    text, split = render(n)
    prefill = tokenizer(text[:split], add_special_tokens=False)["input_ids"]
    decode = tokenizer(text[split:], add_special_tokens=False)["input_ids"]
    return PasskeyPrompt(torch.tensor(prefill), torch.tensor(decode), passkey, depth)


def random_passkey(rng: random.Random, digits: int = 5) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


class PasskeyTrial:
    """One prompt, prefilled once; ``answer(spec)`` decodes the question and answer under ``spec``."""

    def __init__(self, model, tokenizer, prompt: PasskeyPrompt, max_new_tokens: int = 10):
        self.model, self.tokenizer, self.prompt, self.max_new_tokens = model, tokenizer, prompt, max_new_tokens
        self._cache_arg = cache_kwarg(model)
        with torch.no_grad():
            out = model.model(input_ids=prompt.prefill_ids[None], use_cache=True)
        self._prefill_cache = getattr(out, "past_key_values", None) or getattr(out, "cache")

    def answer(self, spec: SelectionSpec, dense_layers: int = 0) -> str:
        harness = SparseAttentionHarness(spec, dense_layers=dense_layers,
                                         decode_from=self.prompt.prefill_ids.numel())
        cache = copy.deepcopy(self._prefill_cache)
        eos = self.tokenizer.eos_token_id
        tokens: list[int] = []
        step_ids = self.prompt.decode_ids[None]
        with use_harness(self.model, harness), torch.no_grad():
            for _ in range(self.max_new_tokens):
                hidden = self.model.model(input_ids=step_ids, use_cache=True,
                                          **{self._cache_arg: cache}).last_hidden_state
                token = int(self.model.lm_head(hidden[:, -1]).argmax(-1))
                if token == eos:
                    break
                tokens.append(token)
                step_ids = torch.tensor([[token]])
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def correct(self, spec: SelectionSpec, dense_layers: int = 0) -> tuple[bool, str]:
        text = self.answer(spec, dense_layers)
        return self.prompt.passkey in "".join(ch for ch in text if ch.isdigit()), text
