"""Cache warm-up: prefill known prompt prefixes into the prefix cache before serving.

A warm-up file holds one prompt per line: plain text, or a JSON object per line
(JSON Lines) ``{"prompt": "..."}`` or ``{"messages": [{"role", "content"}, ...]}``
(rendered with the package's chat template, as ``/v1/chat/completions`` does).
Blank lines are skipped. ``load_warmup`` parses and checks the file (ValueError with
one line naming the file and line); ``warmup_token_ids`` turns the items into prompt
token ids with the package's tokenizer (``render_token_ids``: the same through a
``render.Renderer``, with its limits, as the servers do); ``prefill`` runs each as a ``max_tokens=1``
greedy request through the engine, so its full pages are registered in the prefix
cache and stay there (idle, evictable) until the pool needs them, like any other.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

MAX_WARMUP_PROMPTS = 100_000  # a bound on what one file may ask the server to prefill
MAX_WARMUP_CHARS = 64 << 20  # characters of one rendered warm-up prompt (it is cut to the context later)


def load_warmup(path: str | Path) -> tuple[dict, ...]:
    """Items ``{"prompt": str}`` or ``{"messages": [...]}`` of the warm-up file at ``path``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"warmup file {path}: cannot read it ({type(e).__name__}: {e})") from None
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        items.append(_item(line, f"warmup file {path} line {n}"))
        if len(items) > MAX_WARMUP_PROMPTS:
            raise ValueError(f"warmup file {path}: more than {MAX_WARMUP_PROMPTS} prompts")
    if not items:
        raise ValueError(f"warmup file {path}: no prompts (one per line, or JSON Lines)")
    return tuple(items)


def _item(line: str, where: str) -> dict:
    if not line.startswith("{"):
        return {"prompt": line}
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict) or len(obj.keys() & {"prompt", "messages"}) != 1:
        raise ValueError(f"{where}: expected an object with exactly one of 'prompt' or 'messages'")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        return {"prompt": obj["prompt"]}
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{\"role\": str, \"content\": str}}")
    return {"messages": [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
                         for m in messages]}


def prompt_token_ids(package, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
    """Prompt ids as the server tokenizes them: text with the tokenizer's special tokens,
    chat messages rendered by the chat template (whose special tokens are in the text)."""
    if messages is not None:
        return package.encode(package.apply_chat_template(messages), add_special_tokens=False)
    return package.encode(prompt)


def warmup_token_ids(package, items: Sequence[dict]) -> list[list[int]]:
    """Token ids of each item; ValueError (one line) when the package cannot render one."""
    out = []
    for i, item in enumerate(items):
        try:
            ids = prompt_token_ids(package, item.get("prompt"), item.get("messages"))
        except Exception as e:  # PackageError (no tokenizer / template), a template's own error
            raise ValueError(f"warmup prompt {i + 1}: {' '.join(str(e).split())}") from None
        if not ids:
            raise ValueError(f"warmup prompt {i + 1} has no tokens")
        out.append(ids)
    return out


async def render_token_ids(renderer, items: Sequence[dict]) -> list[list[int]]:
    """``warmup_token_ids`` through ``renderer`` (a ``render.Renderer``): the template and the
    tokenizer run in its workers, under its time and memory limits; ValueError (one line)."""
    from tinyserve_trt.runtime.server.render import RenderError

    out = []
    for i, item in enumerate(items):
        try:
            if item.get("messages") is not None:
                ids = await renderer.chat(item["messages"], MAX_WARMUP_CHARS)
            else:
                (ids,) = await renderer.encode([item["prompt"]], MAX_WARMUP_CHARS)
        except RenderError as e:
            raise ValueError(f"warmup prompt {i + 1}: {e.kind}: {' '.join(e.message.split())}") from None
        if not ids:
            raise ValueError(f"warmup prompt {i + 1} has no tokens")
        out.append(ids)
    return out


async def prefill(llm, prompts: Sequence[Sequence[int]], context: int | None = None) -> int:
    """Run each prompt as a one-token greedy request on ``llm`` (an AsyncLLM), one after the
    other; prompts of ``context`` tokens or more are cut to fit. Returns the prompt tokens sent."""
    from tinyserve_trt.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    sent = 0
    for i, ids in enumerate(prompts):
        ids = list(ids)[: (context - 1) if context else None]
        async for _ in llm.generate(prompt_token_ids=ids, params=params, request_id=f"warmup-{i}"):
            pass
        sent += len(ids)
    return sent
