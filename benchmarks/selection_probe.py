"""Which selection closes a model's sparse-attention gap? Perplexity of one text's last positions under
several page selections, through the HF torch harness (``tinyserve_dev.evaluation``), for any HF folder.

Cheaper than ``tinyserve eval`` (one dense prefill, then each selection in ~30-60 s at 8K on 2 cores), so
it is where defaults are explored; ``tinyserve eval`` through the package's runtime is where they are
confirmed (benchmarks/results/long_context.md). Rows name a selection as
``policy:budget[:sub_page_size[:candidate_share[:group_select]]]`` (sub_page_size 0: single level;
group_select ``head`` / ``union``: each query head of a GQA group selects alone, and attends its own
choice or the group's union - candidate rules, not in the op yet), with the export's page size, sinks,
recent pages and dense layers unless given. The oracle row (exact attention mass of
each page) separates the budget's cost from the ranking's.

    python benchmarks/selection_probe.py --hf-dir /tmp/qwen-hf --text KJV.txt --context 8192 \\
        --rows query_aware:1024:4:0.5,query_aware:1024:0,oracle:1024:0

Appends a section (command, commit, wall time) to benchmarks/results/selection_probe.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tinyserve_trt.export.config import ExportConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_row(text: str) -> dict:
    """``policy:budget[:sub[:share[:group_select]]]`` -> SelectionSpec keywords (ValueError with the row
    on bad input)."""
    parts = text.split(":")
    if not 2 <= len(parts) <= 5:
        raise ValueError(f"row {text!r}: expected policy:budget[:sub_page_size[:candidate_share[:group_select]]]")
    select = parts.pop() if len(parts) == 5 else "shared"
    if select != "shared":
        from tinyserve_dev.evaluation.decode_attention import GROUP_SELECTS  # torch: only for such a row

        if select not in GROUP_SELECTS:
            raise ValueError(f"row {text!r}: group_select must be one of {', '.join(GROUP_SELECTS)}")
    try:
        row = dict(policy=parts[0], budget=int(parts[1]))
        sub = int(parts[2]) if len(parts) > 2 else ExportConfig().resolved_sub_page_size()
        if sub:
            row.update(sub_page_size=sub, candidate_share=float(parts[3]) if len(parts) > 3
                       else ExportConfig().candidate_share)
    except ValueError:
        raise ValueError(f"row {text!r}: budget and sub_page_size are integers, candidate_share a float") from None
    if select != "shared":
        row["group_select"] = select
    return row


def cover_list(costs: list[float], cover: float) -> list[int]:
    """The fewest layers, costliest first, whose positive costs sum to ``cover`` of all positive costs."""
    total = sum(c for c in costs if c > 0)
    chosen, acc = [], 0.0
    for layer in sorted(range(len(costs)), key=lambda i: -costs[i]):
        if costs[layer] <= 0 or acc >= cover * total:
            break
        chosen.append(layer)
        acc += costs[layer]
    return sorted(chosen)


def layer_sensitivity(pp, spec, num_layers: int, dense_nll: float, cover: float) -> tuple[list[str], str]:
    """Rows ``| layer | ppl | NLL cost | rank |`` of ``spec`` in one layer at a time, plus the list line."""
    costs, ppls = [], []
    for layer in range(num_layers):
        t0 = time.perf_counter()
        others = tuple(i for i in range(num_layers) if i != layer)
        r = pp.run(spec, dense_layers=others)
        costs.append(r.nll - dense_nll)
        ppls.append(r.ppl)
        print(f"layer {layer}: NLL cost {costs[-1]:+.5f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    rank = {layer: i + 1 for i, layer in enumerate(sorted(range(num_layers), key=lambda i: -costs[i]))}
    lines = [f"| {i} | {ppls[i]:.4f} | {costs[i]:+.5f} | {rank[i]} |" for i in range(num_layers)]
    chosen = cover_list(costs, cover)
    lines.append(f"\nSummed positive cost {sum(c for c in costs if c > 0):.5f} nats; the layers covering {cover:.0%} "
                 f"of it: `--dense-layers {','.join(map(str, chosen))}`.")
    print(f"--dense-layers {','.join(map(str, chosen))}")
    head = (f"Each layer alone under `{spec.label()}`, every other layer dense: the NLL it adds (nats/token).\n\n"
            "| layer | ppl | NLL cost | rank |\n|---|---|---|---|\n")
    return lines, head


def main(argv=None) -> int:
    defaults = ExportConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf-dir", type=Path, default=None, help="HF model folder (default: SmolLM2, the demo)")
    ap.add_argument("--text", type=Path, default=None, help="plain-text file (default: Hamlet)")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--eval-tokens", type=int, default=512)
    ap.add_argument("--rows", default="query_aware:1024,query_aware:1024:0,oracle:1024:0",
                    help="comma list of policy:budget[:sub_page_size[:candidate_share[:group_select]]]")
    ap.add_argument("--page-size", type=int, default=defaults.resolved_page_size())
    ap.add_argument("--sink-pages", type=int, default=defaults.sink_pages)
    ap.add_argument("--recent-pages", type=int, default=defaults.recent_pages)
    ap.add_argument("--dense-layers", type=int, default=defaults.dense_layers)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=128, help="query rows per attention block (memory)")
    ap.add_argument("--dense-layer-list", default=None,
                    help="comma-separated dense layer indices instead of the leading --dense-layers")
    ap.add_argument("--layer-sensitivity", action="store_true",
                    help="per layer, the first row's selection in that layer alone (the rest dense): its NLL cost, "
                         "ranked, and the --dense-layers list that covers --cover of the summed cost")
    ap.add_argument("--cover", type=float, default=0.8, help="--layer-sensitivity: share of the summed cost to cover")
    ap.add_argument("--out", type=Path, default=RESULTS / "selection_probe.md")
    args = ap.parse_args(argv)
    try:
        names = [r for r in args.rows.split(",") if r]
        rows = [parse_row(r) for r in names]
    except ValueError as e:
        ap.error(str(e))

    import torch

    from tinyserve_dev.evaluation.decode_attention import DENSE, SelectionSpec
    from tinyserve_dev.evaluation.perplexity import PrefixPerplexity
    from tinyserve_dev.evaluation.texts import default_text_path, read_text

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    specs = [SelectionSpec(page_size=args.page_size, sink_pages=args.sink_pages, recent_pages=args.recent_pages,
                           **row) for row in rows]
    if args.hf_dir is None:
        from tinyserve_trt.export.hf.smollm2 import load_hf

        model, tokenizer = load_hf()
        name = "SmolLM2-135M-Instruct"
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(args.hf_dir), dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(args.hf_dir))
        name = args.hf_dir.name
    text = args.text or default_text_path()
    ids = torch.tensor(tokenizer(read_text(text))["input_ids"], dtype=torch.long)
    if ids.numel() < args.context:
        print(f"selection_probe: error: {text} has {ids.numel()} tokens, fewer than --context {args.context}",
              file=sys.stderr)
        return 2
    ids = ids[:args.context]
    pp = PrefixPerplexity(model, ids, args.context - 1 - args.eval_tokens, chunk=args.chunk)
    dense = pp.run(DENSE)
    print(f"dense ppl {dense.ppl:.4f} ({time.perf_counter() - t_start:.0f} s with the prefill)", flush=True)
    dense_layers = args.dense_layers
    if args.dense_layer_list:
        from tinyserve_trt.contracts.dense_layers import parse_dense_layers

        dense_layers = parse_dense_layers(args.dense_layer_list)
    if args.layer_sensitivity:
        lines, table_head = layer_sensitivity(pp, specs[0], model.config.num_hidden_layers, dense.nll, args.cover)
    else:
        lines = []
        table_head = "| selection (policy:budget:sub:share[:select]) | ppl | ratio to dense |\n|---|---|---|\n"
        for row, spec in zip(names, specs):
            t0 = time.perf_counter()
            r = pp.run(spec, dense_layers=dense_layers)
            lines.append(f"| `{row}` | {r.ppl:.4f} | {r.ppl / dense.ppl:.4f} |")
            print(f"{row}: ppl {r.ppl:.4f} = {r.ppl / dense.ppl:.4f}x dense ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    header = (f"\n<!-- {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ} -->\n"
              f"## {name}: {text.name}, last {pp.eval_tokens} of {args.context} positions\n\n"
              f"Command: `python benchmarks/selection_probe.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
              f"({platform.machine()}, commit {commit}, wall {time.perf_counter() - t_start:.0f} s). "
              f"Page {args.page_size}, sinks {args.sink_pages}, recent {args.recent_pages}, "
              f"dense layers {dense_layers}.\n\n{table_head}"
              + (f"| dense | {dense.ppl:.4f} | 1.0000 |\n" if not args.layer_sensitivity else ""))
    if not args.out.exists():
        args.out.write_text("# Selection probe: perplexity under several page selections (HF torch harness)\n\n"
                            "`python benchmarks/selection_probe.py` appends one section per run.\n")
    with open(args.out, "a") as f:
        f.write(header + "\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
