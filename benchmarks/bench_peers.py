"""Decode step and prefill on CPU beside the peers a CPU user picks: ORT GenAI and llama.cpp.

Same weights for all (``scripts/setup_llamacpp.sh`` converts the HF folder a package was exported
from to an F32 GGUF; the GenAI model is built from the same folder), the same prompts (random
token ids, ``bench_decode.prompts``), ``--threads`` threads each, side by side in one run.

--mode decode (per context x batch): tinyserve sparse (budget ``--budget``, default the package's at
each context; dense below ``--sparse-min-ratio`` x budget, the runtime's rule) and dense, as
``bench_decode.py`` times them
(``TinyserveTimer``: one engine per context, its prompt prefix prefilled once and reused by every
batch and pass); ORT GenAI (``--genai-model``; it prefills each batch and pass itself, in
``--genai-chunk`` pieces); llama.cpp (``--gguf``, batch 1 only: llama-cpp-python's ``Llama`` holds one
sequence) in a child process with the llama-cpp-python venv's python (``--llamacpp-python``):
``Llama(gguf, n_ctx, n_threads=T, n_batch=512, logits_all=False)``, the prompt prefilled once per
context with ``eval(ids)``, then each pass cuts the cache back to the prompt and times one
``eval([tok])`` + argmax per step. Median of ``--steps`` steps, best of ``--passes`` passes
(interleaved, so a slow spell hits every column alike; each pass turns the systems' order, and the
table gives each ratio's range and median within the passes beside the ratio of the bests). Each row has the bytes a step reads -
the package graph's weights (an embedding table costs one row per sequence) plus the KV attended
(``tinyserve_dev/peers/step_bytes.py``; GenAI at the package's dtype, llama.cpp's float16 cache) -
and the share of the read bandwidth measured at start. Writes benchmarks/results/peers_decode_cpu.md.

--mode prefill (per prompt length in --contexts): one prompt of token ids; tinyserve
``LLM.generate(prompt_token_ids=[ids], max_tokens=1)`` (prefix sharing off, so each pass
recomputes) vs llama.cpp ``eval(ids)`` from an empty cache; best of ``--passes``; the peak RSS of
each (tinyserve's process mark restarted per prompt, the load included; the llama.cpp child's).
Writes benchmarks/results/peers_prefill_cpu.md.
The last line printed is ``RESULT ...`` (the ratios at the largest context).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from bench_decode import GenaiTimer, TinyserveTimer, prompts  # noqa: E402

from tinyserve_dev.peers import llamacpp, machine  # noqa: E402
from tinyserve_dev.peers.peer_table import (  # noqa: E402
    DecodeRow, PrefillRow, TableHeader, decode_table, pass_ratios, prefill_table)
from tinyserve_dev.peers.step_bytes import StepBytes, StepGeometry, kv_bytes, sparse_applies, weight_bytes  # noqa: E402
from tinyserve_trt.contracts.budget import DecodeBudget  # noqa: E402
from tinyserve_trt.runtime import SamplingParams  # noqa: E402
from tinyserve_trt.runtime.config import EngineConfig, total_ram_bytes  # noqa: E402
from tinyserve_trt.runtime.model_package import ModelPackage  # noqa: E402

RESULTS = HERE / "results"
OUT = {"decode": RESULTS / "peers_decode_cpu.md", "prefill": RESULTS / "peers_prefill_cpu.md"}


def start_peer(args, n_ctx: int, notes: list[str]):
    """A started LlamaCppPeer, or None with the reason added to ``notes`` once."""
    reason = "llama.cpp skipped: --no-llamacpp" if args.no_llamacpp else llamacpp.unavailable(
        args.llamacpp_python, args.gguf)
    reason = getattr(args, "llamacpp_failed", None) or reason  # a child that failed once fails at every context
    if reason is None:
        try:
            peer = llamacpp.LlamaCppPeer(args.llamacpp_python, args.gguf, n_ctx, args.threads)
            if f"llama-cpp-python {peer.version}" not in " ".join(notes):
                notes.append(f"llama.cpp: llama-cpp-python {peer.version}, `{Path(args.gguf).name}`, "
                             f"n_batch 512, its default float16 KV cache")
            return peer
        except llamacpp.PeerError as e:
            reason = args.llamacpp_failed = f"llama.cpp skipped: {e}"
    if reason not in notes:
        notes.append(reason)
        print(reason, file=sys.stderr)
    return None


def prefill_peer(peer, ids: list[int], notes: list[str]) -> int | None:
    """The greedy token after ``ids`` evaluated by ``peer``, or None with the reason in ``notes``."""
    if peer is None:
        return None
    try:
        return peer.eval(ids)["next"]
    except llamacpp.PeerError as e:
        notes.append(f"llama.cpp skipped at {len(ids)} tokens: {e}")
        print(notes[-1], file=sys.stderr)
        return None


def genai_scores_bytes(num_heads: int, rows: list[list[int]], chunk: int) -> int:
    """fp32 attention scores GenAI's prefill materialises: [batch, heads, piece, S], the piece being
    the whole prompt at batch > 1 (GenAI takes one append there)."""
    batch, s = len(rows), len(rows[0])
    return batch * num_heads * (min(chunk, s) if batch == 1 else s) * s * 4


def start_genai(args, rows: list[list[int]], notes: list[str], num_heads: int):
    """A prefilled GenaiTimer; where GenAI's own prefill cannot fit in half the RAM (a one-piece
    16K x 4 prefill would need 60 GB and meet the OOM killer, not an exception) a GenaiGraphTimer
    (its graph, run as its generator runs it: tinyserve_dev/peers/genai_graph.py), with a note; or
    None (no --genai-model, no onnxruntime_genai, another failure: the reason in ``notes``)."""
    if args.genai_model is None:
        return None
    need = genai_scores_bytes(num_heads, rows, args.genai_chunk)
    try:
        if need > total_ram_bytes() // 2:
            from tinyserve_dev.peers.genai_graph import GenaiGraphTimer

            notes.append(f"genai at context {len(rows[0])} batch {len(rows)}: GenAI's own model.onnx in ONNX Runtime "
                         f"as its generator runs it (shared past/present buffers), the shared prompt prefilled at "
                         f"batch 1 in {args.genai_chunk}-token pieces and copied to each row: GenAI 0.18 takes a "
                         f"batch > 1 prompt in one piece, {need / 2 ** 30:.0f} GiB of attention scores")
            return GenaiGraphTimer(args.genai_model, rows, args.steps, args.threads, args.genai_chunk)
        return GenaiTimer(args.genai_model, rows, args.steps, args.threads, args.genai_chunk)
    except ImportError:
        reason = "genai skipped: onnxruntime_genai is not installed (pip install onnxruntime-genai==0.18.0)"
    except Exception as e:  # out of memory at large batch x context, ...
        reason = f"genai skipped at context {len(rows[0])} batch {len(rows)}: {str(e).splitlines()[0][:160]}"
    if reason not in notes:
        notes.append(reason)
        print(reason, file=sys.stderr)
    return None


STEP_ROOM = 8  # positions past the prompt and the timed steps a peer's cache is sized with


def fit_contexts(contexts: list[int], max_context: int, steps: int, notes: list[str]) -> list[int]:
    """Each decode context cut to what leaves room for ``steps`` timed steps inside the model's
    ``max_context`` positions (GenAI refuses a max_length past the model's; so would our engine), a note per cut."""
    room = max_context - steps - STEP_ROOM
    if room < 2:
        raise SystemExit(f"error: --steps {steps} leaves no room for a prompt in the model's {max_context} positions")
    out = []
    for c in contexts:
        if c > room:
            notes.append(f"context {c} cut to {room}: the model holds {max_context} positions, the {steps} timed "
                         f"steps and {STEP_ROOM} more go after the prompt")
            c = room
        out.append(c)
    return list(dict.fromkeys(out))


def budget_text(budget: int | None, package: ModelPackage) -> str:
    if budget is not None:
        return str(budget)
    return f"the package's ({DecodeBudget(package.token_budget, package.budget_share).describe()})"


PASS_ORDER = ("tinyserve", "genai", "llama.cpp")


def pass_order(p: int) -> tuple[str, ...]:
    """The systems in pass ``p``'s order: turned by one each pass (and tinyserve's sparse and dense
    swapped every other pass), so no system is always timed first after a context's setup or
    always right after the same neighbour."""
    k = p % len(PASS_ORDER)
    return PASS_ORDER[k:] + PASS_ORDER[:k]


def run_decode(args, package: ModelPackage, notes: list[str]) -> list[DecodeRow]:
    geometry, weights = StepGeometry.of_package(package), {}
    out = []
    default = DecodeBudget(package.token_budget, package.budget_share)
    for context in fit_contexts(args.contexts, package.max_context, args.steps, notes):
        budget = args.budget
        if budget is None:
            budget = default.at(context)
            notes.append(f"sparse budget at context {context}: {budget} tokens (the package's default)")
        base = prompts(package.vocab_size, context, 1)[0]
        peer = start_peer(args, context + args.steps + STEP_ROOM, notes) if 1 in args.batches else None
        first = prefill_peer(peer, base, notes)  # the prompt, once per context (untimed)
        if first is None and peer is not None:
            peer = peer.close()
        timer = TinyserveTimer(package, base[:-1], max(args.batches), args.steps, args.threads, args.sparse_min_ratio)
        try:
            for batch in args.batches:
                rows, best, passes = prompts(package.vocab_size, context, batch), {}, []
                genai = start_genai(args, rows, notes, package.num_heads)
                for p in range(args.passes):
                    res = {}
                    for name in pass_order(p):
                        if name == "tinyserve":
                            budgets = {"sparse": budget, "dense": 0}
                            res.update(timer.time(rows, budgets if p % 2 == 0 else dict(reversed(budgets.items())),
                                                  args.steps))
                        elif name == "genai" and genai is not None:
                            res["genai"] = genai.time(args.steps)
                        elif name == "llama.cpp" and peer is not None and batch == 1:
                            res["llama.cpp"] = statistics.median(peer.steps(context, first, args.steps))
                    res = {k: v for k, v in res.items() if v is not None}
                    passes.append(res)
                    for k, v in res.items():
                        best[k] = min(best.get(k, float("inf")), v)
                genai = None  # its model and cache go before the next batch's are made
                w = weights.setdefault(batch, weight_bytes(package.model_path, batch))
                dense = StepBytes(w, kv_bytes(geometry, context, batch))
                sizes = {"sparse": StepBytes(w, kv_bytes(geometry, context, batch, budget, args.sparse_min_ratio)),
                         "dense": dense, "genai": dense}
                if batch == 1:
                    sizes["llama.cpp"] = StepBytes(w, kv_bytes(geometry, context, 1, kv_dtype="float16"))
                out.append(DecodeRow(context, batch, best, {k: v for k, v in sizes.items() if k in best}, tuple(passes)))
                mode = "" if sparse_applies(context, budget, args.sparse_min_ratio) else " (sparse decodes dense)"
                print(f"context {context} batch {batch} budget {budget}{mode}: "
                      + " ".join(f"{k}={v * 1e3:.2f}ms" for k, v in best.items()), flush=True)
        finally:
            timer.close()
            if peer is not None:
                peer.close()
    return out


def run_prefill(args, package: ModelPackage, notes: list[str]) -> list[PrefillRow]:
    from tinyserve_trt.runtime.llm import LLM

    out = []
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    exact = machine.reset_peak_rss()
    if not exact:
        notes.append("tinyserve peak RSS: this process's high-water mark (the kernel refused a reset)")
    for n in args.contexts:
        ids = prompts(package.vocab_size, n, 1)[0]
        machine.reset_peak_rss()
        llm = LLM(package, threads=args.threads, prefix_sharing=False, max_batch=1, max_seq_len=n + 8)
        peer = start_peer(args, n + 8, notes)
        best, rss = {}, {}
        try:
            for _ in range(args.passes):
                t0 = time.perf_counter()
                llm.generate(prompt_token_ids=[ids], params=params)
                best["tinyserve"] = min(best.get("tinyserve", float("inf")), time.perf_counter() - t0)
                if peer is not None:
                    try:
                        reply = peer.eval(ids, start=0)
                    except llamacpp.PeerError as e:
                        notes.append(f"llama.cpp skipped at {n} tokens: {e}")
                        peer = peer.close()
                        continue
                    best["llama.cpp"] = min(best.get("llama.cpp", float("inf")), reply["seconds"])
                    rss["llama.cpp"] = reply["peak_rss"]
            rss["tinyserve"] = machine.peak_rss_bytes()
        finally:
            llm.close()
            if peer is not None:
                peer.close()
        out.append(PrefillRow(n, best, rss))
        print(f"prefill {n}: " + " ".join(f"{k}={n / v:.0f} tok/s" for k, v in best.items())
              + f" (tinyserve peak RSS {rss['tinyserve'] / 2 ** 30:.2f} GiB)", flush=True)
    return out


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="tinyserve package (tinyserve-export output)")
    ap.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--genai-model", type=Path, help="an onnxruntime-genai model dir of the same weights (decode)")
    ap.add_argument("--genai-chunk", type=int, default=1024,
                    help="at batch 1 GenAI's prompt goes in pieces of this many tokens (untimed; in one piece a "
                         "16K prompt's attention scores alone need ~15 GB); GenAI takes one piece at batch > 1")
    ap.add_argument("--gguf", type=Path, help="an F32 GGUF of the same weights (scripts/setup_llamacpp.sh)")
    ap.add_argument("--llamacpp-python", type=Path, default=llamacpp.default_python(),
                    help="the llama-cpp-python venv's python (default %(default)s)")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp column")
    ap.add_argument("--contexts", default="512,1024,4096,8000", help="contexts (decode) or prompt lengths (prefill)")
    ap.add_argument("--batches", default="1", help="decode batch sizes (llama.cpp: batch 1 only)")
    ap.add_argument("--budget", type=int, help="sparse budget in tokens (default: the package's at each context)")
    ap.add_argument("--sparse-min-ratio", type=float, default=EngineConfig.sparse_min_ratio,
                    help="sparse decodes dense below this many times the budget (default: the runtime's, %(default)s)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="threads of every system (default 2)")
    ap.add_argument("--bandwidth-mib", type=int, default=1024, help="size of the read-bandwidth probe")
    ap.add_argument("--out", type=Path, help="default benchmarks/results/peers_<mode>_cpu.md")
    args = ap.parse_args(argv)
    try:
        args.contexts = [int(c) for c in args.contexts.split(",")]
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error("--contexts and --batches are comma-separated ints")
    if args.budget is not None and args.budget < 1:
        ap.error("--budget must be >= 1 (omit it for the package's default)")
    if min(args.contexts) < 2 or min(args.batches) < 1:
        ap.error("contexts must be >= 2 and batches >= 1")
    for name in ("steps", "passes", "threads", "bandwidth_mib", "genai_chunk"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    load = machine.load_average()  # before anything of ours runs
    package = ModelPackage.load(args.model)
    bandwidth = machine.read_bandwidth(args.threads, args.bandwidth_mib << 20)
    notes: list[str] = []
    rows = (run_decode if args.mode == "decode" else run_prefill)(args, package, notes)
    if args.mode == "decode" and args.genai_model is None:
        notes.append("genai skipped: no --genai-model given")
    import onnxruntime as ort

    header = TableHeader(
        title=f"{args.mode.capitalize()} on CPU: tinyserve beside ORT GenAI and llama.cpp, same weights",
        command="python benchmarks/bench_peers.py " + shlex.join(argv),
        machine=f"{machine.machine_line()}, onnxruntime {ort.__version__}", threads=args.threads,
        measure=(f"median of {args.steps} decode steps, best of {args.passes} passes" if args.mode == "decode"
                 else f"best of {args.passes} passes"),
        load=load, commit=machine.git_commit(HERE.parent), bandwidth=bandwidth,
        models=f"`{package.path.name}` ({package.num_layers} layers, {package.num_heads} heads / "
               f"{package.num_kv_heads} KV heads, page {package.page_size}, {package.dtype}, "
               f"budget {budget_text(args.budget, package)}, "
               f"sparse from {args.sparse_min_ratio} x budget)"
               + (f"; GenAI `{args.genai_model.name}`" if args.genai_model else ""), notes=tuple(notes),
        probe_mib=args.bandwidth_mib)
    out = args.out or OUT[args.mode]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(decode_table(header, rows) if args.mode == "decode" else prefill_table(header, rows))
    print(f"wrote {out}", file=sys.stderr)
    print(result_line(args.mode, rows))
    return 0


def result_line(mode: str, rows) -> str:
    if mode == "prefill":
        r = max(rows, key=lambda r: r.tokens)
        s = r.seconds
        ratio = s["llama.cpp"] / s["tinyserve"] if "llama.cpp" in s else float("nan")
        return f"RESULT prefill_{r.tokens}_tinyserve_vs_llamacpp={ratio:.2f}"
    r = max(rows, key=lambda r: (r.context, -r.batch))
    s = r.seconds
    ratios = []
    for k in ("genai", "llama.cpp"):
        name = f"sparse_vs_{k.replace('.', '')}_{r.context}_b{r.batch}"
        ratios.append(f"{name}={s['sparse'] / s[k]:.2f}" if k in s else f"{name}=nan")
        each = pass_ratios(r, "sparse", k)
        if len(each) > 1:
            ratios.append(f"{name}_pass_median={statistics.median(each):.2f}")
    return "RESULT " + " ".join(ratios)


if __name__ == "__main__":
    sys.exit(main())
