"""What closes the perplexity gap at budget 1024? Selection variants side by side on SmolLM2.

The same text, prefill and scored decode steps as ``quality.py`` (one dense
prefill shared by every run); each variant changes one knob of the op's
selection - page size, GQA group reduction, sink / recent pages, dense leading
layers - at the same token budget, and reports its perplexity ratio to dense.
Writes benchmarks/results/quality_sweep.md and .json; the LAST line printed is
``RESULT best_ppl_ratio=<ratio> budget=<tokens> variant=<name>``.

Variants are ``name:key=value,key=value`` (keys: page_size, group_reduce,
sink_pages, recent_pages, dense_layers, sub_page_size, candidate_share; unspecified
keys take the exporter's defaults), separated by ``;``. ``sub_page_size`` > 0 is
the op's two-level selection (``ops.two_level``: rank pages, keep
``max(candidate_share x pages, budget // page)`` of them, re-rank their sub-pages
by the 4-bit ``key_sub_bounds`` the runtime stores); ``sub_page_size=0`` single level.

The ``reads`` column models one step's memory traffic per KV head at the full
context, in FP16 key vectors of D channels: min+max of every page, the candidates'
sub-page codes (one byte per channel: half a key vector per sub-page), K+V of the
budget - relative to single-level pages of 16 (``BASELINE``). It is a model, not a
timing: ``bench_page_size.py`` times page sizes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tinyserve_trt.export.config import ExportConfig  # noqa: E402
from tinyserve_dev.evaluation import results as results_io  # noqa: E402
from tinyserve_dev.evaluation.texts import default_text_path, read_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_VARIANTS = ("default:;page8:page_size=8;sum:group_reduce=sum;page8_sum:page_size=8,group_reduce=sum;"
                    "recent4:recent_pages=4;sinks4:sink_pages=4;dense0:dense_layers=0")
KEYS = {"page_size": int, "group_reduce": str, "sink_pages": int, "recent_pages": int, "dense_layers": int,
        "sub_page_size": int, "candidate_share": float, "reuse_steps": int}


BASELINE = dict(page_size=16, sub_page_size=0, candidate_share=0.0)  # what ``reads`` is relative to


def modelled_reads(settings: dict, context: int, budget: int) -> float:
    """Key vectors one decode step reads per KV head (see the module docstring)."""
    reads = 2 * -(-context // settings["page_size"]) + 2 * budget
    if settings["sub_page_size"]:
        pages = -(-context // settings["page_size"])
        candidates = max(int(settings["candidate_share"] * pages), budget // settings["page_size"])
        reads += min(context, candidates * settings["page_size"]) / settings["sub_page_size"] / 2
    return reads


def parse_variants(text: str, defaults: dict) -> list[tuple[str, dict]]:
    """``name:k=v,k=v;...`` -> [(name, full settings)]; ValueError naming the bad part."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, body = part.partition(":")
        settings = dict(defaults)
        for kv in filter(None, body.split(",")):
            key, eq, value = kv.partition("=")
            if not eq or key not in KEYS:
                raise ValueError(f"variant {name!r}: expected key=value with key in {sorted(KEYS)}, got {kv!r}")
            settings[key] = KEYS[key](value)
        out.append((name, settings))
    if not out:
        raise ValueError("no variants given")
    return out


def main(argv=None) -> int:
    d = ExportConfig()
    defaults = dict(page_size=d.resolved_page_size(), group_reduce="max", sink_pages=d.sink_pages,
                    recent_pages=d.recent_pages, dense_layers=d.dense_layers, sub_page_size=d.resolved_sub_page_size(),
                    candidate_share=d.candidate_share, reuse_steps=1)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", type=Path, default=None, help="plain-text file (default: Hamlet)")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--eval-tokens", type=int, default=512)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "quality_sweep")
    args = ap.parse_args(argv)
    try:
        variants = parse_variants(args.variants, defaults)
    except ValueError as e:
        ap.error(str(e))
    import torch

    from tinyserve_dev.evaluation.decode_attention import DENSE, SelectionSpec
    from tinyserve_dev.evaluation.perplexity import PrefixPerplexity
    from tinyserve_trt.export.hf.smollm2 import load_hf

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    text_path = args.text or default_text_path()
    model, tokenizer = load_hf()
    ids = torch.tensor(tokenizer(read_text(text_path))["input_ids"], dtype=torch.long)[:args.context]
    eval_from = ids.numel() - 1 - min(args.eval_tokens, ids.numel() // 2)
    pp = PrefixPerplexity(model, ids, eval_from)
    dense = pp.run(DENSE)
    print(f"dense ppl {dense.ppl:.4f}", flush=True)
    rows = []
    machine = results_io.machine_description(torch.get_num_threads())
    for name, s in variants:
        t0 = time.perf_counter()
        spec = SelectionSpec("query_aware", budget=args.budget, page_size=s["page_size"], sink_pages=s["sink_pages"],
                             recent_pages=s["recent_pages"], group_reduce=s["group_reduce"],
                             sub_page_size=s["sub_page_size"], candidate_share=s["candidate_share"], reuse_steps=s["reuse_steps"])
        r = pp.run(spec, dense_layers=s["dense_layers"])
        n = int(ids.numel())
        reads = modelled_reads(s, n, args.budget) / modelled_reads(BASELINE, n, args.budget)
        rows.append(dict(variant=name, **s, ppl=r.ppl, ratio=r.ppl / dense.ppl, reads=round(reads, 3),
                         seconds=round(time.perf_counter() - t0)))
        print(f"{name:12s} ppl {r.ppl:.4f} ratio {r.ppl / dense.ppl:.4f} ({rows[-1]['seconds']} s)", flush=True)
        data = dict(text=text_path.name, context=int(ids.numel()), prefill_tokens=eval_from,
                    eval_tokens=pp.eval_tokens, budget=args.budget, dense_ppl=dense.ppl, rows=rows,
                    complete=len(rows) == len(variants), wall_seconds=round(time.perf_counter() - t_start))
        results_io.write_json(args.out.with_suffix(".json"), "quality_sweep", data, machine)
        args.out.with_suffix(".md").write_text(render(data, machine, results_io.command_line()))
    best = min(rows, key=lambda r: r["ratio"])
    print(f"RESULT best_ppl_ratio={best['ratio']:.4f} budget={args.budget} variant={best['variant']}")
    return 0


def render(data: dict, machine: str, command: str) -> str:
    lines = [
        "# Selection variants at one token budget: SmolLM2-135M-Instruct", "",
        f"Machine: {machine}. Command: `{command}`.", "",
        f"Text `{data['text']}`, {data['context']} tokens: {data['prefill_tokens']} prefilled densely, "
        f"{data['eval_tokens']} decode steps scored, query_aware at budget {data['budget']} tokens. Dense perplexity "
        f"{data['dense_ppl']:.4f}. Run time {data['wall_seconds']} s"
        + ("." if data["complete"] else " so far (INCOMPLETE)."), "",
        "| variant | page size | sub-page (candidate share) | group reduce | sink pages | recent pages | dense layers "
        "| ppl | ratio to dense | reads (modelled) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        two = f"{r['sub_page_size']} ({r['candidate_share']:.0%})" if r.get("sub_page_size") else "-"
        reads = f"{r['reads']:.2f}x" if "reads" in r else "-"
        lines.append(f"| {r['variant']} | {r['page_size']} | {two} | {r['group_reduce']} | {r['sink_pages']} | "
                     f"{r['recent_pages']} | {r['dense_layers']} | {r['ppl']:.4f} | {r['ratio']:.4f} | {reads} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
