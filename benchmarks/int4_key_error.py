"""INT4 cold pages: the key and value rules of INT4 formats 1-3 (issue #17), attention-output error on SmolLM2.

Captures real queries/keys/values of SmolLM2 (transformers, CPU) on held-out
text (the Python standard library's sources, as ``bench_mixed.py``), quantizes
every full page after the first (the sink stays hot, recent pages included:
the worst case) and compares the attention output of the last ``--queries``
positions with the exact one (relative L2 error per layer, head and query,
``quant_granularity.py``'s measure). Rows:

- K ``sym`` : INT4 format version 1, symmetric per channel over the page,
  ``q in [-7, 7]`` times a float16 ``absmax / 7`` (computed here: the codec no
  longer stores keys so), ``--sub-tokens`` also per channel over that many tokens;
- K ``bounds``: version 2 (and version 3's single-level rule), ``ops/cold_codec.py``:
  16 levels between the page's own key_min/key_max (no stored scale);
- K ``sub-bounds/N``: version 3 in a two-level package, the codec: 16 levels between
  each key's N-token sub-page bounds, decoded from the codes the package stores anyway;
- V ``sym token/16``: version 1-2 (per token in groups of 16 channels, symmetric,
  float16 scales; computed here), ``asym token/16``: version 3, the codec (a float16
  scale + min per group: 2 more bytes per group), ``asym token/32`` the codec with
  groups of 32, ``sym token/8`` symmetric groups of 8;
- K and V together: format 1 = ``sym`` + ``sym token/16``, format 2 = ``bounds`` +
  ``sym token/16``, format 3 = ``sub-bounds/N`` + ``asym token/16``.

Writes ``benchmarks/results/int4_cold_keys.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_granularity import attention, rel_err  # noqa: E402

from tinyserve_trt.ops import fine_bounds  # noqa: E402
from tinyserve_trt.ops.cold_codec import INT4_FORMAT_VERSION, ColdCodec, page_bounds  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def pages_of(x, ps):  # [Hkv, T, D] -> full pages [n, Hkv, ps, D]
    Hkv, T, D = x.shape
    n = T // ps
    return np.transpose(x[:, : n * ps].reshape(Hkv, n, ps, D), (1, 0, 2, 3))


def back(x, deq, ps):
    """``x`` with its full pages after the first replaced by ``deq [n, Hkv, ps, D]``."""
    Hkv, T, D = x.shape
    n = deq.shape[0]
    out = x.copy()
    out[:, ps: n * ps] = np.transpose(deq, (1, 0, 2, 3)).reshape(Hkv, n * ps, D)[:, ps:]
    return out


def f16(a):
    return np.asarray(a, np.float16).astype(np.float64)


def sym_channel(p, tokens):  # p [n, Hkv, ps, D]: INT4 v1 keys, per channel over `tokens` tokens
    n, Hkv, ps, D = p.shape
    g = p.reshape(n, Hkv, ps // tokens, tokens, D)
    amax = np.abs(g).max(axis=3, keepdims=True)
    s = f16(np.where(amax > 0, amax / 7, 1.0))
    return (np.clip(np.rint(g / s), -7, 7) * s).reshape(p.shape)


def sym_groups(p, group):  # V of formats 1-2: per token, `group` channels, symmetric float16 scale each
    g = p.reshape(p.shape[:-1] + (p.shape[-1] // group, group))
    s = f16(np.maximum(np.abs(g).max(-1, keepdims=True), 1e-30) / 7)
    return (np.clip(np.rint(g / s), -7, 7) * s).reshape(p.shape)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/tinyserve/smollm2-hf"))
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--page-sizes", default="32,16")
    ap.add_argument("--sub-tokens", type=int, default=16, help="sym K over this many tokens too (0: not)")
    ap.add_argument("--sub-page", type=int, default=4, help="K on the sub-page fine bounds (0: not)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "int4_cold_keys.md"))
    args = ap.parse_args(argv)
    from tinyserve_trt.calibration.hf_source import HFSource

    t0 = time.perf_counter()
    src = HFSource(args.model, threads=args.threads)
    D, L = src.head_dim, src.num_layers
    scale = 1.0 / np.sqrt(D)
    codec = ColdCodec("int4", "channel", "token", 16)  # format 3: what a package stores
    codec32 = ColdCodec("int4", "channel", "token", 32)
    caps = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        ids = src.tokenize(path.read_text(errors="ignore"))
        if len(ids) >= args.tokens:
            (q, k, v), _ = src._capture(ids[: args.tokens])
            caps.append((path.name, q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)))
        if len(caps) == args.prompts:
            break
    rows: dict = {}
    for ps in (int(x) for x in args.page_sizes.split(",")):
        for _, q, k, v in caps:
            T = k.shape[2]
            pos = list(range(T - args.queries, T))
            for layer in range(L):
                kl, vl = k[layer], v[layer]
                ref = attention(q[layer], kl, vl, pos, scale)
                kp, vp = pages_of(kl, ps), pages_of(vl, ps)
                kmin, kmax = page_bounds(kp)
                K = {"sym": back(kl, sym_channel(kp, ps), ps),
                     "bounds": back(kl, codec.dequantize_keys(*codec.quantize(kp, "k"), kmin, kmax), ps)}
                if args.sub_page:  # format 3, two-level: on the codes of the (hot) keys
                    codes = fine_bounds.pages_sub_bounds(kp, args.sub_page, kmin, kmax, np.full(kp.shape[0], ps))
                    deq = codec.dequantize_keys(*codec.quantize(kp, "k", sub_codes=codes), kmin, kmax,
                                                sub_codes=codes)
                    K[f"sub-bounds/{args.sub_page}"] = back(kl, deq, ps)
                if args.sub_tokens and args.sub_tokens < ps:
                    K[f"sym/{args.sub_tokens} tokens"] = back(kl, sym_channel(kp, args.sub_tokens), ps)
                V = {"sym token/16": back(vl, sym_groups(vp, 16), ps),
                     "asym token/16": back(vl, codec.dequantize(*codec.quantize(vp, "v")), ps),
                     "asym token/32": back(vl, codec32.dequantize(*codec32.quantize(vp, "v")), ps),
                     "sym token/8": back(vl, sym_groups(vp, 8), ps)}
                combos = [(kn, None) for kn in K] + [(None, vn) for vn in V] + \
                    [("sym", "sym token/16"), ("bounds", "sym token/16"), ("bounds", "asym token/16")]
                if args.sub_page:
                    sb = f"sub-bounds/{args.sub_page}"
                    combos += [(sb, "sym token/16"), (sb, "asym token/16"), (sb, "asym token/32"),
                               (sb, "sym token/8")]
                for kn, vn in combos:
                    out = attention(q[layer], K[kn] if kn else kl, V[vn] if vn else vl, pos, scale)
                    rows.setdefault((ps, kn or "exact", vn or "exact"), []).append(rel_err(out, ref).ravel())
    cmd = "python benchmarks/int4_key_error.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = ["# INT4 cold pages: formats 1-3, keys and values (SmolLM2-135M)", "",
             f"`{cmd.strip()}` - {len(caps)} held-out prompts (stdlib: {', '.join(c[0] for c in caps)}), "
             f"{args.tokens} tokens, {L} layers x {src.num_heads} query / {src.num_kv_heads} KV heads, D={D}. "
             "Every full page after the first quantized (recent ones too: the worst case), the last "
             f"{args.queries} positions as queries; relative L2 error of the attention output per "
             f"(layer, head, query). {time.perf_counter() - t0:.0f} s.", "",
             "| page | K | V | mean rel. error | p99 |", "|---|---|---|---|---|"]
    for (ps, kn, vn), e in rows.items():
        e = np.concatenate(e)
        lines.append(f"| {ps} | {kn} | {vn} | {e.mean():.4f} | {np.quantile(e, 0.99):.4f} |")
    lines += ["", "K `sym`: INT4 format version 1 (absmax / 7 per channel over the page, float16 scale); "
              "`bounds`: version 2 and version 3 single-level (16 levels on key_min/key_max, no stored scale); "
              f"`sub-bounds/{args.sub_page}`: version 3 two-level (16 levels on each sub-page's decoded fine "
              "bounds, no extra bytes). V `sym token/16`: versions 1-2 (symmetric, float16 scale per token and "
              "16 channels); `asym token/16`: version 3 (float16 scale + min per group). The codec "
              f"(`ops/cold_codec.py`, format {INT4_FORMAT_VERSION}) computes `bounds`, `sub-bounds` and `asym`; "
              "`sym` rows are computed here.", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
