"""Hot/cold mixed-precision KV pages (issues #6, #17): KV bytes vs greedy top-1 agreement and perplexity.

For each package (``--model``, repeatable: e.g. an ``--cold-pages int4`` and an
``int8`` export of the same model, shown side by side) and each hot fraction
(``--fractions``; 1.0 is the all-hot reference, run once on the first package;
``default`` stands for the packages' own hot fractions, what they ship with)
``--prompts`` held-out prompts of ``--context`` tokens go through the engine
(chunked prefill, then ``--decode`` greedy steps) with the package's cold tier:
pages the op rarely selects are demoted between steps.

- KV bytes: per sequence, its live pages at its last step (hot pages at the
  package's dtype, cold ones as INT8/INT4 values + scales + key_min/key_max),
  summed, divided by the same pages all hot at the package's dtype - the
  baseline is all-FP16 pages for an FP16 package (``--fp16``), all-FP32 for an
  FP32 one, and the table says which. FP32 packages also get the same page
  counts priced as FP16 pages (what an FP16 deployment would save).
- Top-1 agreement: the fraction of scored positions whose greedy token
  equals the all-hot run's at the same position, every run teacher-forced on
  the same tokens (so one disagreement does not compound).
- Perplexity: ``exp`` of the mean negative log-likelihood of the forced tokens
  over the scored positions, and its ratio to the all-hot run's.

Prompts: ``--data`` (JSON Lines ``text``/``prompt`` or plain lines), else the
Python standard library's source files in sorted order (text the calibration,
done on this repository's docs, never saw), each cut to ``--context`` tokens;
the forced tokens are the all-hot run's greedy continuation (``--decode`` of
them, the first predicted by the prefill), so its perplexity is the model's
confidence in its own continuation. ``--text FILE`` (or ``--text hamlet``:
``benchmarks/quality.py``'s default text) instead cuts one long text into
``--prompts`` consecutive windows of ``--context`` tokens and forces the text
itself, as ``quality.py`` scores it: the first ``context - decode - 1`` tokens
are prefilled, the last ``--decode`` positions are scored decode steps - a
real perplexity of the text.
Writes ``benchmarks/results/mixed_precision.md`` + ``.json``; the LAST line is
``RESULT kv_bytes_ratio=<r> top1_agreement=<a>`` at the chosen setting: the
lowest ratio whose agreement meets ``--min-agreement``, else the best agreement.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tinyserve_trt.runtime import SamplingParams  # noqa: E402
from tinyserve_trt.runtime.config import CacheConfig, EngineConfig  # noqa: E402
from tinyserve_trt.runtime.engine import Engine  # noqa: E402
from tinyserve_trt.runtime.model_package import ModelPackage  # noqa: E402
from tinyserve_trt.runtime.sampling import SampleOutput  # noqa: E402
from tinyserve_trt.ops.cold_codec import INT4_FORMAT_VERSION  # noqa: E402
from tinyserve_trt.runtime.tiers import TierConfig, cold_page_bytes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HAMLET = "hamlet"  # --text: the default text of benchmarks/quality.py


def load_prompts(package: ModelPackage, n: int, context: int, data: str | None) -> list[list[int]]:
    """``n`` token lists of exactly ``context`` tokens (texts too short are skipped)."""
    if data:
        from tinyserve_trt.calibration.cli import read_prompts

        texts = iter(read_prompts(data))
    else:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        texts = (p.read_text(errors="ignore") for p in sorted(stdlib.glob("*.py")))
    prompts = []
    for text in texts:
        ids = package.encode(text)
        if len(ids) >= context:
            prompts.append(ids[:context])
        if len(prompts) == n:
            return prompts
    raise SystemExit(f"bench_mixed: only {len(prompts)} prompts of {context} tokens found (wanted {n})")


def text_windows(package: ModelPackage, n: int, context: int, decode: int,
                 text: str) -> tuple[list[list[int]], dict[str, list[int]]]:
    """``n`` consecutive ``context``-token windows of one long text: (prompts = each window's first
    ``context - decode - 1`` tokens, request -> the rest, forced: the first is the prefill's
    (unscored) prediction, then ``decode`` scored decode steps)."""
    from tinyserve_dev.evaluation.texts import default_text_path, read_text

    if decode < 1 or context < decode + 2:
        raise SystemExit(f"bench_mixed: --context {context} must exceed --decode {decode} + 1 with --text")
    try:
        path = default_text_path() if text == HAMLET else Path(text)
        ids = package.encode(read_text(path))
    except OSError as e:
        raise SystemExit(f"bench_mixed: cannot read --text {text}: {e}") from None
    if len(ids) < n * context:
        raise SystemExit(f"bench_mixed: {path} is {len(ids)} tokens: {len(ids) // context} windows of {context} "
                         f"(wanted --prompts {n})")
    windows = [ids[i * context:(i + 1) * context] for i in range(n)]
    cut = context - decode - 1
    return [w[:cut] for w in windows], {f"p{i}": w[cut:] for i, w in enumerate(windows)}


def nll(logits: np.ndarray, token: int) -> float:
    """Negative log-likelihood of ``token`` under ``logits [vocab]`` (float64 log-sum-exp)."""
    row = np.asarray(logits, np.float64)
    top = row.max()
    return float(top + np.log(np.exp(row - top).sum()) - row[token])


class TeacherForcer:
    """A sampler that feeds the forced tokens (request -> tokens; None: greedy's own choice)
    and records, per request and sampled position, greedy's choice and the fed token's NLL."""

    def __init__(self, forced: dict[str, list[int]] | None = None):
        self.forced = forced
        self.greedy: dict[str, list[int]] = {}
        self.nll: dict[str, list[float]] = {}

    def __call__(self, logits, seqs, active=None) -> SampleOutput:
        tokens = np.full(len(seqs), -1, np.int64)
        for i, seq in enumerate(seqs):
            if active is not None and not active[i]:
                continue
            best = int(np.argmax(logits[i]))
            want = best if self.forced is None else self.forced[seq.request_id][seq.num_output_tokens]
            self.greedy.setdefault(seq.request_id, []).append(best)
            self.nll.setdefault(seq.request_id, []).append(nll(logits[i], want))
            tokens[i] = want
        return SampleOutput(tokens)


def score(run: dict, reference: dict, skip: int) -> dict:
    """Top-1 agreement with ``reference``'s greedy choices and perplexity of the forced tokens over
    the scored positions (each request's sampled positions after the first ``skip``)."""
    agree = [a == b for rid, g in run["greedy"].items() for a, b in zip(g[skip:], reference["greedy"][rid][skip:])]
    nlls = [x for v in run["nll"].values() for x in v[skip:]]
    ref_nlls = [x for v in reference["nll"].values() for x in v[skip:]]
    ppl, ref_ppl = float(np.exp(np.mean(nlls))), float(np.exp(np.mean(ref_nlls)))
    return dict(agreement=float(np.mean(agree)), positions=len(agree), nll_mean=float(np.mean(nlls)),
                perplexity=ppl, ppl_ratio=ppl / ref_ppl)


def run(package: ModelPackage, prompts, fraction: float, args, forced=None, max_tokens=None) -> dict:
    """One hot fraction over all prompts, teacher-forced on ``forced`` (request -> tokens; None:
    greedy's own); returns the fed tokens, greedy's choices and NLLs per request, page counts."""
    config = EngineConfig(hot_fraction=fraction, prefix_sharing=False, max_batch=args.batch, kv_scales=args.kv_scales,
                          prefill_chunk=args.prefill_chunk, max_tokens_per_step=args.prefill_chunk * args.batch,
                          max_seq_len=args.context + args.decode, threads=args.threads,
                          sparse_min_ratio=args.sparse_min_ratio)
    engine = Engine(package, config)
    if engine.tiering is None:
        raise SystemExit(f"bench_mixed: {package.path} has no cold tier (export it with --calibration)")
    forcer = engine.sampler = TeacherForcer(forced)
    params = SamplingParams(temperature=0, max_tokens=max_tokens or args.decode, ignore_eos=True)
    seqs = [engine.add_request(f"p{i}", p, params) for i, p in enumerate(prompts)]
    last = {}  # request -> (hot, cold) pages after its latest step
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        pool = engine.pool
        for s in engine.scheduler.running:
            hot = sum(pool.is_hot(p) for p in s.pages)
            last[s.request_id] = (hot, len(s.pages) - hot)
        if args.check_integrity:
            engine.pool.check_integrity([s.pages for s in engine.scheduler.running])
    seconds = time.perf_counter() - t0
    hot, cold = (int(sum(v[i] for v in last.values())) for i in (0, 1))
    stats = engine.stats()
    engine.close()
    return dict(hot_fraction=fraction, tokens={s.request_id: s.output_token_ids for s in seqs}, hot_pages=hot,
                cold_pages=cold, demoted=stats["pages_demoted"], seconds=seconds, greedy=forcer.greedy,
                nll=forcer.nll)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, action="append",
                    help="package with a cold tier (--cold-pages int4|int8 or --calibration); repeat to compare "
                         "formats of one model (the first one's all-hot run is the reference)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens (with --text: window tokens)")
    ap.add_argument("--decode", type=int, default=16, help="positions scored per prompt")
    ap.add_argument("--fractions", default="1.0,default",
                    help="hot fractions, comma-separated; 1.0 is the reference, 'default' the packages' own "
                         "(their manifests' cold_tier.hot_fraction: what a user gets); e.g. 1.0,0.5,0.25,0.1")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--data", help="prompts file (default: Python stdlib sources)")
    src.add_argument("--text", metavar="FILE", help=f"one long plain text cut into --prompts windows of --context "
                     f"tokens, the text forced ('{HAMLET}': Hamlet, benchmarks/quality.py's default text)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--sparse-min-ratio", type=float, default=0.0,
                    help="decode dense below this many times the budget (default 0: the op selects at every "
                         "context, as this benchmark's results so far were measured; the runtime's default is 4)")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--min-agreement", type=float, default=0.99)
    ap.add_argument("--target-ratio", type=float, default=0.50)  # issue #17: <= 0.50 of all-FP16
    ap.add_argument("--check-integrity", action="store_true", help="pool integrity check after every step")
    ap.add_argument("--kv-scales", choices=("dynamic", "static"), default="dynamic",
                    help="cold-page INT8 scales: per page (dynamic) or the calibration's ranges (static)")
    ap.add_argument("--out", default=str(RESULTS / "mixed_precision.md"))
    args = ap.parse_args(argv)

    packages = [ModelPackage.load(m) for m in args.model]
    package = packages[0]
    geometry = {(p.dtype, p.page_size, p.num_layers, p.num_kv_heads, p.head_dim) for p in packages}
    if len(geometry) > 1:
        raise SystemExit(f"bench_mixed: the packages differ in dtype/page size/geometry {sorted(geometry)}")
    fractions = []
    for f in args.fractions.split(","):
        for x in ([p.cold_tier["hot_fraction"] for p in packages] if f.strip() == "default" else [float(f)]):
            if x not in fractions:
                fractions.append(x)
    if 1.0 not in fractions:
        fractions.insert(0, 1.0)
    if args.text:
        prompts, forced = text_windows(package, args.prompts, args.context, args.decode, args.text)
        skip, max_tokens = 1, args.decode + 1  # the prefill's prediction is fed, not scored
    else:
        prompts, forced, skip, max_tokens = load_prompts(package, args.prompts, args.context, args.data), None, 0, None
    print(f"bench_mixed: {len(prompts)} prompts x {args.context} tokens, {args.decode} positions each, "
          f"hot fractions {fractions}", file=sys.stderr, flush=True)
    ref = run(package, prompts, 1.0, args, forced, max_tokens)
    forced = forced or ref["tokens"]  # prompts: the all-hot greedy continuation
    print(f"bench_mixed: hot 100% (reference): {ref['hot_pages']} pages, {ref['seconds']:.0f}s", file=sys.stderr,
          flush=True)
    dims = (package.page_size, package.num_layers, package.num_kv_heads, package.head_dim)
    rows = [dict(ref, **score(ref, ref, skip), cold_format="-", package=str(package.path))]
    prices = {}
    for pkg in packages:
        tiers = TierConfig(1, pkg.cold_tier["k_granularity"], pkg.cold_tier["v_granularity"],
                           cold_format=pkg.cold_tier.get("cold_format", "int8"),
                           group_size=pkg.cold_tier.get("group_size", 0),
                           int8_layers=pkg.cold_tier.get("int8_layers") or ())
        fmt = tiers.describe()  # e.g. "int4 (int8 layers 0,1)": bytes summed over the per-layer codecs
        prices[fmt] = (tiers, {dt: (CacheConfig.page_bytes(*dims, dt), cold_page_bytes(tiers, *dims, dt))
                               for dt in ("float32", "float16")})
        for f in fractions:
            if f != 1.0:
                r = run(pkg, prompts, f, args, forced, max_tokens)
                r.update(score(r, ref, skip))
                rows.append(dict(r, cold_format=fmt, package=str(pkg.path)))
                print(f"bench_mixed: {fmt} hot {f:.0%}: agreement {r['agreement']:.4f}, perplexity "
                      f"{r['perplexity']:.4f} ({r['ppl_ratio']:.4f} x all-hot), {r['cold_pages']} of "
                      f"{r['hot_pages'] + r['cold_pages']} pages cold, {r['seconds']:.0f}s", file=sys.stderr,
                      flush=True)

    for r in rows:
        for key in ("tokens", "greedy", "nll"):
            r.pop(key)
        total = r["hot_pages"] + r["cold_pages"]
        price = prices.get(r["cold_format"], next(iter(prices.values())))[1]
        for dt, (hb, cb) in price.items():
            r[f"ratio_{dt}"] = (r["hot_pages"] * hb + r["cold_pages"] * cb) / (total * hb)
    own = f"ratio_{package.dtype}"
    baseline = f"all pages hot at {package.dtype} (the packages' dtype)"
    ok = [r for r in rows if r["agreement"] >= args.min_agreement]
    chosen = min(ok, key=lambda r: r[own]) if ok else max(rows[1:] or rows, key=lambda r: r["agreement"])
    met = chosen[own] <= args.target_ratio and chosen["agreement"] >= args.min_agreement
    command = "python benchmarks/bench_mixed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Hot/cold mixed-precision KV pages: KV bytes vs greedy top-1 agreement",
        "",
        f"Written by `{command}` ({platform.machine()}, {platform.python_version()}).",
        "",
        f"Model: {package.manifest.get('model_name', package.path.name)}, {package.dtype} hot pages, page size "
        f"{package.page_size}, cold tiers: "
        + "; ".join(f"{fmt} (K per {t.k_granularity} / V per {t.v_granularity}"
                    f"{f' in groups of {t.group_size} channels' if t.group_size else ''}, "
                    f"{f'float16 scales + mins, format {INT4_FORMAT_VERSION}' if t.cold_format == 'int4' else ''}"
                    f"{'float32 scales' if t.cold_format == 'int8' else ''}"
                    f"{'; its int8 layers: float32 scales' if t.int8_layers else ''})"
                    for fmt, (t, _) in prices.items())
        + f", {args.kv_scales} scales, token budget {package.token_budget}, {package.manifest['dense_layers']} dense "
        f"layers. " + (f"{len(prompts)} consecutive windows of {args.context} tokens of {args.text}, the last "
                       f"{args.decode} positions of each scored, teacher-forced on the text"
                       if args.text else f"{len(prompts)} prompts x {args.context} tokens, {args.decode} positions "
                       "each teacher-forced on the all-hot greedy continuation")
        + f" ({len(prompts) * args.decode} per setting). Perplexity: exp of the mean NLL of the forced tokens.",
        "",
        f"Baseline of the KV bytes ratio: {baseline}. A cold page (all layers, each in its own format) costs "
        + ", ".join(f"{fmt} {p[package.dtype][1] / p[package.dtype][0]:.3f}" for fmt, (_, p) in prices.items())
        + f" of a hot {package.dtype} page"
        + ("" if package.dtype == "float16" else " (of an FP16 page: " + ", ".join(
            f"{fmt} {p['float16'][1] / p['float16'][0]:.3f}" for fmt, (_, p) in prices.items()) + ")") + ".",
        "",
        f"| cold format | hot fraction | hot pages | cold pages | KV bytes / all-{package.dtype} | "
        + ("same pages, fp16 hot | " if package.dtype != "float16" else "")
        + "top-1 agreement | perplexity | ppl / all-hot | seconds |",
        "|---|---|---|---|---|" + ("---|" if package.dtype != "float16" else "") + "---|---|---|---|",
    ]
    for r in rows:
        fp16 = f"{r['ratio_float16']:.3f} | " if package.dtype != "float16" else ""
        lines.append(f"| {r['cold_format']} | {r['hot_fraction']:.0%} | {r['hot_pages']} | {r['cold_pages']} | "
                     f"{r[own]:.3f} | {fp16}{r['agreement']:.4f} | {r['perplexity']:.4f} | {r['ppl_ratio']:.4f} | "
                     f"{r['seconds']:.0f} |")
    lines += ["", f"Chosen setting (lowest bytes with agreement >= {args.min_agreement}): {chosen['cold_format']} "
              f"hot fraction {chosen['hot_fraction']:.0%}, KV bytes ratio {chosen[own]:.3f} vs {baseline}, top-1 "
              f"agreement {chosen['agreement']:.4f}. Target (ratio <= {args.target_ratio} at agreement >= "
              f"{args.min_agreement}): {'met' if met else 'NOT met'}.", ""]
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(dict(command=command, rows=rows, chosen=chosen, target_met=met,
                                                        baseline=baseline,
                                                        prompts=len(prompts), context=args.context, text=args.text,
                                                        kv_scales=args.kv_scales,
                                                        decode=args.decode), indent=2) + "\n")
    print("\n".join(lines))
    print(f"RESULT kv_bytes_ratio={chosen[own]:.4f} top1_agreement={chosen['agreement']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
