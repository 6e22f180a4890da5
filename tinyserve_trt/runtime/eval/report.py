"""The eval's tables (markdown)."""

from __future__ import annotations


def _budget(b: int) -> str:
    return "dense" if b == 0 else str(b)


def perplexity_table(rows, text_name: str, context: int) -> str:
    dense = rows[0].ppl
    lines = [f"## Perplexity: {text_name}, last {rows[0].tokens} of {context} positions (teacher-forced decode)\n",
             "| budget | ppl | ratio to dense |", "|---|---|---|"]
    lines += [f"| {_budget(r.budget)} | {r.ppl:.4f} | {r.ppl / dense:.4f} |" for r in rows]
    return "\n".join(lines) + "\n"


def passkey_table(rows) -> str:
    budgets = list(dict.fromkeys(r.budget for r in rows))
    trials = list(dict.fromkeys((r.seed, r.depth) for r in rows))
    by = {(r.seed, r.depth, r.budget): r for r in rows}
    lines = [f"## Passkey retrieval ({len(trials)} prompts)\n",
             "| seed | depth | tokens | " + " | ".join(_budget(b) for b in budgets) + " |",
             "|---|---|---|" + "---|" * len(budgets)]
    for seed, depth in trials:
        cells = [("ok" if by[seed, depth, b].correct else f"miss ({by[seed, depth, b].answer[:12]!r})")
                 for b in budgets]
        lines.append(f"| {seed} | {depth:g} | {by[seed, depth, budgets[0]].context} | " + " | ".join(cells) + " |")
    acc = [sum(by[s, d, b].correct for s, d in trials) for b in budgets]
    lines.append("| | | **correct** | " + " | ".join(f"**{a}/{len(trials)}**" for a in acc) + " |")
    return "\n".join(lines) + "\n"
