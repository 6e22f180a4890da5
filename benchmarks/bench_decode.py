"""Decode tokens/s on CPU: tinyserve sparse vs dense vs the original export vs ORT GenAI.

Side by side in one run, per (context, batch):
  sparse    - tinyserve runtime, Quest budget --budget tokens; a context below
              --sparse-min-ratio x budget decodes dense (the runtime's rule, EngineConfig)
  dense     - tinyserve runtime, dense budget (0)
  original  - the source export in ONNX Runtime with its own past/present cache
  genai     - onnxruntime-genai on --genai-model, when the package and model are there
The batch shares one prompt of `context` tokens but for its last token (each
row decodes its own stream): tinyserve prefills it once and every row, sparse
and dense, reuses its pages; the original prefills it once in chunks and stacks the cache
B times (its batch-8 x 8K prefill would need ~29 GB). Only decode steps are
timed: the median over --steps steps, best of --passes passes.
Writes benchmarks/results/decode_cpu.md and decode_cpu.json (the report's decode
format, ``tinyserve_dev/evaluation/results.py``); the LAST line printed is
``RESULT speedup_8k_b8_vs_original=<original step time / sparse step time>``
(named after the largest context and batch measured).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tinyserve_trt.runtime import SamplingParams  # noqa: E402
from tinyserve_trt.runtime.config import CacheConfig, EngineConfig  # noqa: E402
from tinyserve_trt.runtime.engine import Engine  # noqa: E402
from tinyserve_trt.runtime.model_package import ModelPackage  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def find_source(package: ModelPackage, given: Path | None) -> Path | None:
    """The original export: --source, else a file with the manifest's sha256 next to the
    package or under ~/.cache/tinyserve."""
    if given is not None:
        return given
    src = package.manifest.get("source", {})
    name, sha = src.get("path"), src.get("sha256")
    if not name:
        return None
    dirs = [package.path.parent, *package.path.parent.iterdir(), *Path("~/.cache/tinyserve").expanduser().glob("*")]
    for d in dirs:
        cand = Path(d) / name
        if cand.is_file() and (sha is None or _sha256(cand) == sha):
            return cand
    return None


def prompts(vocab: int, context: int, batch: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    base = rng.integers(3, vocab, context - 1).tolist()
    return [base + [int(3 + (7 * b) % (vocab - 3))] for b in range(batch)]


class TinyserveTimer:
    """One engine whose prefix cache holds a prefilled shared prompt prefix (a warm-up request);
    :meth:`time` runs a batch of rows that extend it, once per named budget (the budget is a
    per-request parameter), so only the rows' last tokens are prefilled again - across budgets,
    batches and passes alike. Pages for ``max_rows`` rows of ``len(prefix) + 1 + max_new`` tokens."""

    def __init__(self, package: ModelPackage, prefix: list[int], max_rows: int, max_new: int, threads: int,
                 sparse_min_ratio: float = EngineConfig.sparse_min_ratio):
        ps = package.page_size
        pages = (max_rows + 1) * -(-(len(prefix) + 1 + max_new + 2) // ps) + 8
        page_bytes = CacheConfig.page_bytes(ps, package.num_layers, package.num_kv_heads, package.head_dim,
                                            package.dtype)
        self.engine = Engine(package, EngineConfig(memory=pages * page_bytes, max_batch=max_rows, threads=threads,
                                                   prefill_chunk=512, max_tokens_per_step=2048,
                                                   sparse_min_ratio=sparse_min_ratio))
        self._ids = itertools.count()
        warm = self.engine.add_request("prefix", list(prefix) + [1], SamplingParams(temperature=0, max_tokens=2))
        while not warm.is_finished:
            self.engine.step()

    def time(self, rows: list[list[int]], budgets: dict[str, int], steps: int) -> dict[str, float]:
        """Median seconds per decode step of the whole batch, per named budget (0 = dense)."""
        engine, result = self.engine, {}
        for name, budget in budgets.items():
            params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True, token_budget=budget)
            seqs = [engine.add_request(f"{name}-{next(self._ids)}", r, params) for r in rows]
            while any(s.num_output_tokens == 0 for s in seqs):
                engine.step()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            while engine.has_unfinished():
                engine.step()
            result[name] = statistics.median(times)
        return result

    def close(self) -> None:
        self.engine.close()


def time_tinyserve(package: ModelPackage, rows: list[list[int]], budgets: dict[str, int], steps: int,
                   threads: int, sparse_min_ratio: float = EngineConfig.sparse_min_ratio,
                   stats: dict | None = None) -> dict[str, float]:
    """Median seconds per decode step of the whole batch, per named budget (0 = dense), on a fresh
    ``TinyserveTimer`` over the rows' shared prefix; ``stats``, if given, receives the engine's
    ``stats()`` at the end."""
    timer = TinyserveTimer(package, rows[0][:-1], len(rows), steps, threads, sparse_min_ratio)
    try:
        result = timer.time(rows, budgets, steps)
        if stats is not None:
            stats.update(timer.engine.stats())
    finally:
        timer.close()
    return result


def time_original(source: Path, source_io: dict, rows: list[list[int]], steps: int, threads: int,
                  chunk: int = 1024) -> float:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = threads, 3
    sess = ort.InferenceSession(str(source), so, providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in sess.get_inputs()}
    names = [o.name for o in sess.get_outputs()]
    pasts, presents = source_io["past_inputs"], source_io["present_outputs"]
    past = {n: np.zeros((1, shapes[n][1], 0, shapes[n][3]), np.float32) for n in pasts}

    def run(ids: np.ndarray, pos: int, past: dict) -> dict:
        b, s = ids.shape
        feeds = {source_io["input_ids"]: ids, **past}
        if source_io.get("attention_mask"):
            feeds[source_io["attention_mask"]] = np.ones((b, pos + s), np.int64)
        if source_io.get("position_ids"):
            feeds[source_io["position_ids"]] = np.broadcast_to(np.arange(pos, pos + s, dtype=np.int64), (b, s)).copy()
        return dict(zip(names, sess.run(None, feeds)))

    prefix = np.asarray(rows[0][:-1], np.int64)[None]
    for start in range(0, prefix.shape[1], chunk):  # chunked prefill of the shared prefix, batch 1
        out = run(prefix[:, start:start + chunk], start, past)
        past = {p: out[o] for p, o in zip(pasts, presents)}
    b, pos = len(rows), prefix.shape[1]
    past = {k: np.repeat(v, b, axis=0) for k, v in past.items()}
    tokens = np.asarray([[r[-1]] for r in rows], np.int64)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        out = run(tokens, pos, past)
        times.append(time.perf_counter() - t0)
        past = {p: out[o] for p, o in zip(pasts, presents)}
        tokens = out[source_io["logits"]][:, -1].argmax(-1).astype(np.int64)[:, None]
        pos += 1
    return statistics.median(times[1:])


class GenaiTimer:
    """onnxruntime-genai on a batch of rows: the model loaded and the prompt prefilled once;
    :meth:`time` times decode steps, each later call first rewinding to the prompt (``rewind_to``).
    At batch 1 the prompt goes in ``chunk``-token pieces: in one piece its prefill materialises
    [batch, heads, S, S] fp32 scores, 60 GB for one 32K prompt of 14 heads. GenAI 0.18 allows
    neither at batch > 1 ("AppendTokens can only be called once for batch_size > 1"): there the
    prompt goes in one piece and each later call prefills a fresh generator.
    ``threads``: its session's intra-op threads (None: its own default, every core)."""

    def __init__(self, model_dir: Path, rows: list[list[int]], max_new: int, threads: int | None = None,
                 chunk: int | None = None):
        import onnxruntime_genai as og

        self.og, self.rows, self.max_new, self.chunk = og, np.asarray(rows, np.int32), max_new, chunk
        config = og.Config(str(model_dir))
        if threads is not None:  # genai_config.json's session options, overlaid
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        self.gen, self.rewinds = self._prefilled(), 0

    def _prefilled(self):
        og, ids = self.og, self.rows
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=ids.shape[1] + self.max_new + 2, batch_size=ids.shape[0], do_sample=False)
        gen = og.Generator(self.model, params)
        piece = self.chunk if self.chunk and ids.shape[0] == 1 else ids.shape[1]
        for start in range(0, ids.shape[1], piece):
            gen.append_tokens(ids[:, start:start + piece])
        self._fresh = True
        return gen

    def time(self, steps: int) -> float:
        """Median seconds per decode step of the whole batch over ``steps`` steps."""
        if not self._fresh:
            try:
                self.gen.rewind_to(self.rows.shape[1] - 1)
                self.gen.append_tokens(self.rows[:, -1:])
                self.rewinds += 1
            except Exception:  # GenAI refuses to rewind at batch > 1: prefill again
                self.gen = self._prefilled()
        self._fresh = False
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.gen.generate_next_token()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def time_genai(model_dir: Path, rows: list[list[int]], steps: int, threads: int | None = None,
               chunk: int | None = None) -> float | None:
    """onnxruntime-genai decode step on a fresh ``GenaiTimer``; None without onnxruntime_genai."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return None
    return GenaiTimer(model_dir, rows, steps, threads, chunk).time(steps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="tinyserve package (tinyserve-export output)")
    ap.add_argument("--source", type=Path, help="the original export (default: found by the manifest's sha256)")
    ap.add_argument("--no-original", action="store_true",
                    help="skip the original export's columns (its 8K batch-8 steps take minutes)")
    ap.add_argument("--genai-model", type=Path, help="an onnxruntime-genai model dir of the same model")
    ap.add_argument("--contexts", default="512,1024,4096,8000")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--sparse-min-ratio", type=float, default=EngineConfig.sparse_min_ratio,
                    help="sparse decodes dense below this many times the budget (default: the runtime's, %(default)s)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="ORT intra-op threads of every system (default 2)")
    ap.add_argument("--out", type=Path, default=RESULTS / "decode_cpu.md")
    args = ap.parse_args(argv)
    package = ModelPackage.load(args.model)
    source = None if args.no_original else find_source(package, args.source)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    rows_out = []
    for context in contexts:
        for batch in batches:
            rows = prompts(package.vocab_size, context, batch)
            best: dict[str, float] = {}
            for _ in range(args.passes):  # interleaved, so a slow spell hits every column alike
                res = time_tinyserve(package, rows, {"sparse": args.budget, "dense": 0}, args.steps, args.threads,
                                     args.sparse_min_ratio)
                if source is not None:
                    res["original"] = time_original(source, package.manifest["source_io"], rows, args.steps,
                                                    args.threads)
                if args.genai_model is not None:
                    try:
                        res["genai"] = time_genai(args.genai_model, rows, args.steps, args.threads)
                    except Exception as e:  # out of memory at large batch x context, ...
                        print(f"genai {context}x{batch}: {str(e).splitlines()[0][:100]}", file=sys.stderr)
                for k, v in res.items():
                    if v is not None:
                        best[k] = min(best.get(k, float("inf")), v)
            rows_out.append((context, batch, best))
            line = " ".join(f"{k}={v * 1e3:.2f}ms" for k, v in best.items())
            print(f"context {context} batch {batch}: {line}", flush=True)
    write_table(args, package, source, rows_out)
    context, batch, best = max(rows_out, key=lambda r: (r[0], r[1]))
    ratio = best["original"] / best["sparse"] if "original" in best else float("nan")
    label = f"{round(context / 1024)}k" if context >= 1000 else str(context)
    print(f"RESULT speedup_{label}_b{batch}_vs_original={ratio:.2f}")
    return 0


def write_table(args, package: ModelPackage, source, rows) -> None:
    import onnxruntime as ort

    cols = ["sparse", "dense", "original", "genai"]
    lines = [
        "# Decode speed on CPU: tinyserve sparse / dense vs the original export",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {args.threads} ORT threads; onnxruntime "
        f"{ort.__version__}. Model: `{package.path.name}` ({package.num_layers} layers, {package.num_heads} heads / "
        f"{package.num_kv_heads} KV heads, page {package.page_size}, {package.dtype}). Original: "
        f"`{source.name if source else 'not found'}`. Command: `python benchmarks/bench_decode.py --model "
        f"{args.model}" + (f" --genai-model {args.genai_model}" if args.genai_model else "")
        + f" --contexts {args.contexts} --batches {args.batches} --budget {args.budget} "
        f"--sparse-min-ratio {args.sparse_min_ratio} --steps {args.steps} "
        f"--passes {args.passes} --threads {args.threads}` (median of {args.steps} decode steps, best of "
        f"{args.passes} passes; genai / x > 1 means x is faster than ORT GenAI).",
        "",
        "| context | batch | " + " | ".join(f"{c} ms/step (tok/s)" for c in cols)
        + " | sparse vs original | genai / sparse | genai / dense |",
        "|---|---|" + "---|" * (len(cols) + 3),
    ]
    for context, batch, best in rows:
        cells = [f"{best[c] * 1e3:.1f} ({batch / best[c]:.0f})" if c in best else "n/a" for c in cols]
        ratios = [f"{best[a] / best[b]:.2f}x" if a in best and b in best else "n/a"
                  for a, b in (("original", "sparse"), ("genai", "sparse"), ("genai", "dense"))]
        lines.append(f"| {context} | {batch} | " + " | ".join(cells + ratios) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    write_json(args.out.with_suffix(".json"), rows, args.threads, budget=args.budget)
    print(f"wrote {args.out}", file=sys.stderr)


SYSTEMS = {"sparse": "tinyserve sparse b{budget}", "dense": "tinyserve dense", "original": "original export (ORT)",
           "genai": "ORT GenAI"}


def write_json(path: Path, rows, threads: int, budget: int) -> None:
    """The report's decode format: one row per (system, context, batch)."""
    from tinyserve_dev.evaluation import results as results_io

    records = [dict(system=SYSTEMS[k].format(budget=budget), context=context, batch=batch,
                    ms_per_token=round(v * 1e3 / batch, 3), ms_per_step=round(v * 1e3, 3),
                    tokens_per_s=round(batch / v, 2))
               for context, batch, best in rows for k, v in best.items() if k in SYSTEMS]
    import onnxruntime as ort

    machine = f"{platform.machine()}, {os.cpu_count()} cores, {threads} ORT threads, onnxruntime {ort.__version__}"
    results_io.validate_decode(dict(rows=records))
    results_io.write_json(path, "decode", dict(rows=records), machine)


if __name__ == "__main__":
    sys.exit(main())
