"""``tinyserve eval PKG``: does sparse attention hurt *this* model on *this* text?

    tinyserve eval PKG --text FILE --context 8192 [--eval-tokens 512] [--budgets 512,1024,2048]
    tinyserve eval PKG --passkey --context 16384 [--depths 0,0.25,0.5,0.75,1] [--seeds 0,1]

Perplexity of the text's last ``--eval-tokens`` positions, dense vs each budget (``perplexity.py``),
and passkey retrieval (``passkey.py``), through the package's runtime; a markdown table on stdout
(and in ``--out``), progress on stderr. ``--budgets`` defaults to the package's own budget at the
context (its floor and share).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="perplexity and passkey retrieval, sparse vs dense, through the runtime")
    e.add_argument("model_dir", metavar="MODEL_DIR", help="package written by tinyserve-export")
    e.add_argument("--text", type=Path, help="plain-text file: teacher-forced perplexity of its last positions")
    e.add_argument("--passkey", action="store_true", help="passkey retrieval at --depths x --seeds")
    e.add_argument("--context", type=int, default=None, help="tokens of context (default: the package's max)")
    e.add_argument("--eval-tokens", type=int, default=512, help="positions scored at the end (default %(default)s)")
    e.add_argument("--budgets", type=_ints, default=None, help="token budgets, comma list (default: the package's)")
    e.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    e.add_argument("--seeds", type=_ints, default=[0, 1])
    e.add_argument("--threads", type=int, default=None)
    e.add_argument("--prefill-chunk", type=int, default=512)
    e.add_argument("--out", type=Path, help="also write the table (markdown) here")


class _Bar:
    """``label [#####     ] 50% (12 s)`` redrawn on a terminal; a line per 25% elsewhere."""

    def __init__(self, label: str, stream=None):
        stream = stream if stream is not None else sys.stderr
        self.label, self.stream, self.t0, self.last = label, stream, time.perf_counter(), -1
        self.tty = stream.isatty()

    def __call__(self, done: int, total: int) -> None:
        share = done / max(1, total)
        secs = time.perf_counter() - self.t0
        if self.tty:
            end = "\n" if done >= total else ""
            self.stream.write(f"\r{self.label} [{'#' * round(24 * share):<24}] {share:4.0%} ({secs:.0f} s){end}")
            self.stream.flush()
        elif int(share * 4) > self.last:
            self.last = int(share * 4)
            print(f"{self.label}: {share:.0%} ({secs:.0f} s)", file=self.stream, flush=True)


def run(args) -> int:
    from tinyserve_trt.runtime.eval.passkey import build_prompt, passkey, random_passkey
    from tinyserve_trt.runtime.eval.perplexity import perplexity
    from tinyserve_trt.runtime.eval.report import passkey_table, perplexity_table
    from tinyserve_trt.runtime.llm import engine_from
    from tinyserve_trt.runtime.model_package import ModelPackage

    if args.text is None and not args.passkey:
        raise ValueError("give --text FILE (perplexity) and/or --passkey")
    package = ModelPackage.load(args.model_dir)
    context = args.context or package.max_context
    if not 2 <= context <= package.max_context:
        raise ValueError(f"--context must be in [2, {package.max_context}] (the package's max context)")
    # default: the package's budget at this context (DecodeBudget: a floor and a share of the context),
    # held for every evaluated position (the runtime's grows with the context: at most eval-tokens x share less)
    budgets = args.budgets or [package.decode_budget.at(context)]
    if any(b < 0 or b > package.max_context for b in budgets):
        raise ValueError(f"--budgets must be in [0, {package.max_context}]")
    modes = 1 + len([b for b in set(budgets) if b])
    engine = engine_from(package, 0, {}, threads=args.threads, prefill_chunk=args.prefill_chunk,
                         max_tokens_per_step=max(args.prefill_chunk, modes), max_batch=modes,
                         max_seq_len=context + 32, sparse_min_ratio=0.0)  # a budget row always selects
    sections = [f"# tinyserve eval: {package.path.name}\n",
                f"package {package.path}, context {context} tokens, budgets {budgets} (0 = dense; the package's "
                f"default: {package.decode_budget.describe()})\n"]
    if args.text is not None:
        try:
            text = args.text.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise ValueError(f"{args.text}: {e.strerror or e}") from None
        ids = package.encode(text)[:context]
        if len(ids) < context:
            raise ValueError(f"{args.text}: {len(ids)} tokens, shorter than --context {context}")
        rows = perplexity(engine, ids, args.eval_tokens, budgets, _Bar(f"perplexity at {context}"))
        sections.append(perplexity_table(rows, args.text.name, context))
    if args.passkey:
        results = []
        for seed in args.seeds:
            for depth in args.depths:
                prompt = build_prompt(package, context, depth, random_passkey(seed, depth))
                results += passkey(engine, prompt, budgets, seed, _Bar(f"passkey depth {depth:g} seed {seed}"))
        sections.append(passkey_table(results))
    out = "\n".join(sections)
    print(out)
    if args.out:
        args.out.write_text(out + "\n")
    return 0
