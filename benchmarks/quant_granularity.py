"""Which INT8 (or INT4) scale granularity for cold KV pages: attention-output error per byte on SmolLM2.

Captures real queries/keys/values of SmolLM2 (transformers, CPU) on local
text (this repository's docs and sources: no downloads), quantizes every full
page of the cache with each (K granularity, V granularity) of
``ops/quantization.py`` and compares the attention output of the last
``--queries`` positions (every full page cold except ``--hot-sink-pages``
sink pages, recent ones included; the query's own token exact) with the unquantized one:
relative error ``||o_q - o|| / ||o||`` per (layer, head, query), averaged.
Bytes = int8 values + float32 scales per token and KV head (fp16 = 2 * D).
``--bits 4``: the packed INT4 format (``ops/cold_codec.py``) with K per channel on
the page bounds (``int4_key_error.py`` compares that with symmetric scales), V per
token, channel or head, float16 scales, in channel groups of ``--groups``
(``token/32`` = one scale per token and 32 channels); writes
``quant_granularity_int4.md``.

Writes benchmarks/results/quant_granularity.md; the last line printed is
``RESULT best=<K>/<V> ...`` (lowest error among the Pareto-optimal choices).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tinyserve_trt.ops.cold_codec import ColdCodec, page_bounds  # noqa: E402
from tinyserve_trt.ops.quantization import GRANULARITIES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"


def local_texts(n: int) -> list[str]:
    """``n`` different ~8 KB texts from this repository (prose and code)."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tinyserve_trt/runtime/scheduler.py",
             ROOT / "tinyserve_trt/ops/function.py", ROOT / "tinyserve_trt/export/pipeline.py"]
    texts = [f.read_text()[:8000] for f in files if f.exists() and len(f.read_text()) > 4000]
    return texts[:n]


def codec_of(bits: int, name: str) -> ColdCodec:
    """``channel`` / ``token`` / ``token/32`` ... as a codec whose V (and INT8 K) use it; INT4 keys
    are per channel on the page bounds whatever the name (``ops/cold_codec.py``)."""
    gran, _, group = name.partition("/")
    return ColdCodec("int8" if bits == 8 else "int4", gran if bits == 8 else "channel", gran, int(group or 0))


def fake_quant(x: np.ndarray, ps: int, codec: ColdCodec, hot_sinks: int = 0, which: str = "v") -> np.ndarray:
    """Quantize-dequantize the full pages of ``x [Hkv, T, D]`` (``which``: "k" or "v") after the
    first ``hot_sinks`` (a partial tail stays exact)."""
    Hkv, T, D = x.shape
    n = T // ps
    pages = np.transpose(x[:, : n * ps].reshape(Hkv, n, ps, D), (1, 0, 2, 3))  # [n, Hkv, ps, D]
    q, s = codec.quantize(pages, which)
    deq = codec.dequantize_keys(q, s, *page_bounds(pages)) if which == "k" else codec.dequantize(q, s)
    out = x.copy()
    out[:, hot_sinks * ps: n * ps] = np.transpose(deq, (1, 0, 2, 3)).reshape(Hkv, n * ps, D)[:, hot_sinks * ps:]
    return out


def attention(q, k, v, positions, scale):
    """Outputs ``[H, Q, D]`` of queries at ``positions`` over keys ``[0, t]`` (causal)."""
    H, Hkv = q.shape[0], k.shape[0]
    G = H // Hkv
    kq = np.repeat(k, G, axis=0)  # [H, T, D]
    vq = np.repeat(v, G, axis=0)
    qs = q[:, positions]  # [H, Q, D]
    logits = np.einsum("hqd,htd->hqt", qs, kq) * scale
    T = k.shape[1]
    mask = np.arange(T)[None, None, :] > np.asarray(positions)[None, :, None]
    logits = np.where(mask, -np.inf, logits)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqt,htd->hqd", p, vq)


def rel_err(a, b):
    return np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(b, axis=-1), 1e-12)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/tinyserve/smollm2-hf"))
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--queries", type=int, default=32, help="last positions used as decode queries")
    ap.add_argument("--page-sizes", default="16,32")
    ap.add_argument("--hot-sink-pages", type=int, default=1,
                    help="leading pages kept exact, as the runtime never demotes sinks (0: all cold)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bits", type=int, choices=(8, 4), default=8)
    ap.add_argument("--groups", default="16,32", help="--bits 4: channel groups of per-token scales")
    ap.add_argument("--out", default=None, help="default results/quant_granularity[_int4].md")
    args = ap.parse_args(argv)
    args.out = args.out or str(RESULTS / ("quant_granularity.md" if args.bits == 8 else "quant_granularity_int4.md"))
    if args.bits == 8:
        names = list(GRANULARITIES)
    else:
        names = ["channel", "token", "head"] + [f"{g}/{n}" for n in args.groups.split(",") for g in ("token", "head")]
    k_names = names if args.bits == 8 else ["channel"]  # INT4 keys: per channel on the page bounds

    from tinyserve_trt.calibration.hf_source import HFSource

    t0 = time.perf_counter()
    src = HFSource(args.model, threads=args.threads)
    D, Hkv, L = src.head_dim, src.num_kv_heads, src.num_layers
    scale = 1.0 / np.sqrt(D)
    page_sizes = [int(x) for x in args.page_sizes.split(",")]
    captures = []
    for text in local_texts(args.prompts):
        ids = src.tokenize(text)[: args.tokens]
        (q, k, v), _ = src._capture(ids)
        captures.append((q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)))
    print(f"captured {len(captures)} prompts of {[c[1].shape[2] for c in captures]} tokens "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)

    rows = {}  # (ps, kg, vg) -> list of errors; kg/vg None = exact
    combos = [(kg, None) for kg in k_names] + [(None, vg) for vg in names] + list(itertools.product(k_names, names))
    for ps in page_sizes:
        for q, k, v in captures:
            T = k.shape[2]
            positions = list(range(T - args.queries, T))
            for layer in range(L):
                ref = attention(q[layer], k[layer], v[layer], positions, scale)
                kq = {g: fake_quant(k[layer], ps, codec_of(args.bits, g), args.hot_sink_pages, "k") for g in k_names}
                vq = {g: fake_quant(v[layer], ps, codec_of(args.bits, g), args.hot_sink_pages, "v") for g in names}
                for kg, vg in combos:
                    out = attention(q[layer], kq[kg] if kg else k[layer], vq[vg] if vg else v[layer], positions,
                                    scale)
                    rows.setdefault((ps, kg, vg), []).append(rel_err(out, ref).ravel())
    print(f"measured in {time.perf_counter() - t0:.0f} s", flush=True)

    def nbytes(g, ps, which):  # per token and KV head
        return 2 * D if g is None else codec_of(args.bits, g).bytes_per_page(which, 1, ps, D) / ps

    fmt = f"INT{args.bits}"
    cmd = "python benchmarks/quant_granularity.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# {fmt} scale granularity for cold KV pages (SmolLM2-135M)", "",
             f"`{cmd.strip()}` - {len(captures)} prompts of this repository's text, "
             f"{captures[0][1].shape[2]} tokens, {L} layers x {src.num_heads} query / {Hkv} KV heads, D={D}. "
             f"Every full page of the cache after the first {args.hot_sink_pages} (sinks stay hot) quantized, "
             f"including the recent ones (worst case), the last {args.queries} positions "
             "as queries; relative L2 error of the attention output per (layer, head, query).",
             f"Bytes per token and KV head include the {'float32' if args.bits == 8 else 'float16'} scales (fp16 hot: "
             f"{2 * D} B for K and {2 * D} for V).", ""]
    best = None
    for ps in page_sizes:
        lines += [f"## page size {ps}", "", "| K | V | bytes/token (K+V) | vs fp16 | mean rel. error | p99 | Pareto |",
                  "|---|---|---|---|---|---|---|"]
        entries = []
        for kg, vg in combos:
            e = np.concatenate(rows[(ps, kg, vg)])
            b = nbytes(kg, ps, "k") + nbytes(vg, ps, "v")
            entries.append((kg or "fp16", vg or "fp16", b, float(e.mean()), float(np.quantile(e, 0.99))))
        both = [x for x in entries if "fp16" not in x[:2]]
        pareto = {x for x in both if not any(y[2] <= x[2] and y[3] < x[3] for y in both)}
        for x in sorted(entries, key=lambda x: (x[2], x[3])):
            mark = "yes" if x in pareto else ""
            lines.append(f"| {x[0]} | {x[1]} | {x[2]:.1f} | {x[2] / (4 * D):.2f} | {x[3]:.4f} | {x[4]:.4f} | {mark} |")
        lo, cheap = min(pareto, key=lambda x: x[3]), min(pareto, key=lambda x: x[2])
        lines += ["", f"Lowest error: K {lo[0]} / V {lo[1]}, {lo[3]:.4f} at {lo[2]:.1f} B/token "
                  f"({lo[2] / (4 * D):.2f} of fp16); the cheapest, K {cheap[0]} / V {cheap[1]}, has "
                  f"{cheap[3] / lo[3]:.1f}x its error for {1 - cheap[2] / lo[2]:.0%} fewer bytes.", ""]
        if ps == page_sizes[0]:
            best, cheapest = lo, cheap
    lines += ["K-only / V-only rows (the other in fp16) separate the two errors. "
              f"Pareto = no other {fmt} pair is at most as many bytes with a lower mean error.", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"RESULT best={best[0]}/{best[1]} err={best[3]:.4f} bytes={best[2]:.1f} "
          f"cheapest={cheapest[0]}/{cheapest[1]} err={cheapest[3]:.4f} bytes={cheapest[2]:.1f} "
          f"(page size {page_sizes[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
