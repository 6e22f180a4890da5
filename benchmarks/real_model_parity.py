"""Greedy ids of a real model's package (dense, through the runtime) vs HF torch's (issue #30).

    python benchmarks/real_model_parity.py --source MODEL.gguf|HF_DIR --package PKG [--max-tokens 24]

Three prompts: a chat prompt (the model's chat template), a code prompt, and a ~1.8K-token
prompt (this repository's docs). HF torch (fp32, eager greedy) and ``LLM(PKG, dense=True)``
each generate ``--max-tokens`` tokens; a mismatch is reported with the margin between the top
two HF logits at the first differing step (a near-tie when < 1e-3). Writes
benchmarks/results/real_model_parity.md (one file per benchmark, rewritten by each run).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHAT = "Write one sentence on what a KV cache is."
CODE = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def long_prompt(tokenizer, n: int = 1800) -> list[int]:
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n]
    return ids + tokenizer("\n\nSummarize the text above in one sentence:", add_special_tokens=False)["input_ids"]


def hf_greedy(model, ids: list[int], steps: int):
    import torch

    out, margins = [], []
    with torch.no_grad():
        past = None
        x = torch.tensor([ids])
        for _ in range(steps):
            res = model(input_ids=x, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[0, -1].double()
            top = torch.topk(logits, 2).values
            margins.append(float(top[0] - top[1]))
            tok = int(torch.argmax(logits))
            out.append(tok)
            x = torch.tensor([[tok]])
    return out, margins


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True, type=Path, help="the GGUF file or HF folder the package came from")
    ap.add_argument("--package", required=True, type=Path, action="append", help="package(s) to check")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/real_model_parity.md")
    args = ap.parse_args()
    from tinyserve_trt import LLM, SamplingParams
    from tinyserve_trt.export.hf.convert import load_model

    t0 = time.perf_counter()
    model, tok = load_model(args.source)
    load_s = time.perf_counter() - t0
    chat = tok.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True, tokenize=False)
    prompts = {"chat": tok(chat, add_special_tokens=False)["input_ids"],
               "code": tok(CODE, add_special_tokens=False)["input_ids"], "long": long_prompt(tok)}
    want = {k: hf_greedy(model, v, args.max_tokens) for k, v in prompts.items()}
    del model
    rows, ok = [], True
    for pkg in args.package:
        llm = LLM(str(pkg), dense=True)
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        for name, ids in prompts.items():
            got = list(llm.generate(params=params, prompt_token_ids=[ids])[0].outputs[0].token_ids)
            ref, margins = want[name]
            first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
            if first is None:
                verdict = "equal"
            elif margins[first] < 1e-3:
                verdict = f"near-tie at step {first} (HF top-2 margin {margins[first]:.1e})"
            else:
                verdict, ok = f"DIFFERS at step {first} (HF top-2 margin {margins[first]:.2f})", False
            rows.append((pkg.name, name, len(ids), verdict, tok.decode(got)[:60].replace("\n", "\\n").replace("|", "/")))
        del llm
    lines = ["# Greedy ids: package (dense, runtime) vs HF torch", "",
             f"Command: `python benchmarks/real_model_parity.py --source {args.source.name} "
             + " ".join(f"--package {p.name}" for p in args.package) + f" --max-tokens {args.max_tokens}`",
             f"Machine: {platform.machine()}, {platform.system()}; HF load {load_s:.0f} s.", "",
             "| package | prompt | prompt tokens | greedy ids | package output (start) |", "|---|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} | `{e}` |" for a, b, c, d, e in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
