"""Passkey retrieval through the runtime: a number hidden at a depth of filler text, asked for at the end.

The prompt is one chat-template user turn (the package's own template): an instruction, filler
sentences with the passkey line at ``depth`` (0 = start, 1 = end), then the question. Everything
before the question is the prompt, prefilled densely once; the question and the template's tail
are decode steps fed as given (teacher forcing), so the selection decides whether the model still
sees the passkey when it answers - as Quest evaluates it. Greedy answer; correct when its digits
contain the passkey. Quest's and tinyserve_dev's harness use the same text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tinyserve_trt.runtime.eval.forcing import TeacherForcing
from tinyserve_trt.runtime.eval.steps import run_requests
from tinyserve_trt.runtime.sampling import SamplingParams

INSTRUCTION = ("There is an important pass key hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about the pass key.\n\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? Answer with the number only."
ANSWER_TOKENS = 10


@dataclass(frozen=True)
class PasskeyPrompt:
    prompt_ids: list[int]  # instruction + filler + needle: prefilled
    question_ids: list[int]  # question + template tail: decode steps, given
    passkey: str
    depth: float


def build_prompt(package, context: int, depth: float, passkey: str) -> PasskeyPrompt:
    """A prompt of at most ``context`` tokens (within one filler sentence) with the passkey at ``depth``."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if package.chat_template is None:
        raise ValueError(f"{package.path}: the package has no chat template for the passkey prompt")

    def render(n: int) -> tuple[str, int]:
        before = round(n * depth)
        body = INSTRUCTION + FILLER * before + NEEDLE.format(key=passkey) + FILLER * (n - before)
        text = package.apply_chat_template([{"role": "user", "content": body + QUESTION}])
        return text, text.index(QUESTION)

    def length(n: int) -> int:
        return len(package.encode(render(n)[0], add_special_tokens=False))

    per_filler = len(package.encode(FILLER * 8, add_special_tokens=False)) / 8
    n = max(0, int((context - length(0)) / per_filler))
    while n > 0 and length(n) > context:
        n -= max(1, int((length(n) - context) / per_filler))
    text, split = render(n)
    return PasskeyPrompt(package.encode(text[:split], add_special_tokens=False),
                         package.encode(text[split:], add_special_tokens=False), passkey, depth)


def random_passkey(seed: int, depth: float, digits: int = 5) -> str:
    rng = random.Random(f"{seed}:{depth}")
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


@dataclass(frozen=True)
class PasskeyRow:
    depth: float
    seed: int
    context: int  # tokens of the prompt and question
    budget: int  # 0 = dense
    answer: str
    correct: bool


def passkey(engine, prompt: PasskeyPrompt, budgets, seed: int = 0, progress=None) -> list[PasskeyRow]:
    """One prompt prefilled once; dense and each budget answer it side by side."""
    modes = [0] + [b for b in dict.fromkeys(int(b) for b in budgets) if b != 0]
    forcing = TeacherForcing(engine)
    try:
        requests = {}
        for b in modes:
            rid = f"passkey-{b}"
            forcing.force(rid, prompt.question_ids)
            # ignore_eos: the question's template tail holds the end-of-turn token; the answer is cut at EOS below
            requests[rid] = (prompt.prompt_ids, SamplingParams(temperature=0, token_budget=b, ignore_eos=True,
                                                               max_tokens=len(prompt.question_ids) + ANSWER_TOKENS))
        outputs = run_requests(engine, requests, progress)
    finally:
        forcing.close()
    rows = []
    for b in modes:
        ids = outputs[f"passkey-{b}"][len(prompt.question_ids):]
        stop = set(engine.package.eos_token_ids)
        answer = engine.package.decode(ids[:next((i for i, t in enumerate(ids) if t in stop), len(ids))])
        digits = "".join(ch for ch in answer if ch.isdigit())
        rows.append(PasskeyRow(prompt.depth, seed, len(prompt.prompt_ids) + len(prompt.question_ids), b,
                               answer.strip(), prompt.passkey in digits))
    return rows
