"""Which layers make INT4 cold pages lose agreement? End-to-end KL per layer on SmolLM2 (issue #17).

Runs SmolLM2 (transformers, CPU) over held-out prompts (Python standard library
sources read from the END of the sorted list, so none of ``bench_mixed.py``'s
64 prompts, which it takes from the start), then for each of the last
``--positions`` positions decodes that token over a cache whose cold pages are
replaced by their codec round trip (``ops/cold_codec.py``: INT4 format 3 - keys
on the page bounds in the leading ``--dense-layers``, on the 4-token sub-page
codes elsewhere, as a two-level package stores them; V asymmetric per token in
groups of 16 - or INT8), with dense attention in every layer (the worst case:
the op would read only the selected pages). Cold pages are the full pages that
are neither the sink, the last two pages, nor among the ``--hot`` share of pages
kept hot, chosen like the runtime after a prefill (the most recent) or, for the
``*_hits`` rows, by the op's page selections at the scored positions
(``calibration.selection.replay_selection``, single level at the package's page
size and budget).

Reported per variant: the mean KL(all hot || variant) of the next-token
distribution and top-1 agreement with the all-hot token. Variants:
``int4_now`` (every layer INT4: a package without INT8 layers),
``int4_dense8`` (the dense layers INT8), ``int4_dense_sub`` (the dense layers'
INT4 keys on sub-page codes too), ``int8_all``, ``top{1,2,3}_8`` (the
``--int8-layers`` first 1/2/3 INT8), the ``_hits`` hot choice, and with
``--per-layer`` ``only{l}`` (only layer ``l`` INT4, the rest exact: what
``tinyserve-calibrate``'s sensitivity pass measures).

Writes ``--out`` (.json); prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tinyserve_trt.calibration.selection import replay_selection  # noqa: E402
from tinyserve_trt.ops import fine_bounds, schema  # noqa: E402
from tinyserve_trt.ops.cold_codec import ColdCodec, page_bounds  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def prompts_from_stdlib(src, n: int, tokens: int, skip: set[str]) -> list[tuple[str, list[int]]]:
    out = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), reverse=True):
        ids = src.tokenize(f.read_text(errors="ignore"))
        if len(ids) >= tokens and f.name not in skip:
            out.append((f.name, ids[:tokens]))
        if len(out) == n:
            break
    return out


def round_trips(k: np.ndarray, v: np.ndarray, ps: int, sub: int) -> dict:
    """Every full page of ``k``/``v [Hkv, T, D]`` through each codec, back in token order."""
    def pages(x):
        n = x.shape[1] // ps
        return np.transpose(x[:, :n * ps].reshape(x.shape[0], n, ps, x.shape[2]), (1, 0, 2, 3)).astype(np.float64)

    def tokens(p):
        n, h, _, d = p.shape
        return np.transpose(p, (1, 0, 2, 3)).reshape(h, n * ps, d)

    c4, c8 = ColdCodec("int4", "channel", "token", 16), ColdCodec("int8", "channel", "token", 0)
    kp, vp = pages(k), pages(v)
    kmin, kmax = page_bounds(kp)
    codes = fine_bounds.pages_sub_bounds(kp, sub, kmin, kmax, np.full(kp.shape[0], ps))
    return {"k4b": tokens(c4.dequantize_keys(*c4.quantize(kp, "k"), kmin, kmax)),
            "k4s": tokens(c4.dequantize_keys(*c4.quantize(kp, "k", sub_codes=codes), kmin, kmax, sub_codes=codes)),
            "v4": tokens(c4.dequantize(*c4.quantize(vp, "v"))),
            "k8": tokens(c8.dequantize(*c8.quantize(kp, "k"))), "v8": tokens(c8.dequantize(*c8.quantize(vp, "v")))}


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/tinyserve/smollm2-hf"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--skip", default="", help="comma-separated stdlib file names to leave out (e.g. the ones "
                                              "that chose --int8-layers)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--positions", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--sub-page-size", type=int, default=4)
    ap.add_argument("--dense-layers", type=int, default=2)
    ap.add_argument("--hot", type=float, default=0.2)
    ap.add_argument("--int8-layers", default="18,23,20", help="ranked layers for the top{1,2,3}_8 rows")
    ap.add_argument("--per-layer", action="store_true", help="also only{l}: one layer INT4 at a time")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "int4_layer_sensitivity.json")
    args = ap.parse_args(argv)

    import torch
    from transformers import DynamicCache

    from tinyserve_trt.calibration.hf_source import HFSource

    ps, sub = args.page_size, args.sub_page_size
    src = HFSource(args.model, page_size=ps, token_budget=1024, threads=args.threads)
    L, dense = src.num_layers, args.dense_layers
    prompts = prompts_from_stdlib(src, args.prompts, args.context + args.positions, set(filter(None, args.skip.split(","))))
    ranked = [int(x) for x in args.int8_layers.split(",") if x]

    def fmts(int8=(), dense_fmt="4b", only=None, all8=False):
        out = []
        for layer in range(L):
            f = "8" if all8 or layer in int8 else (dense_fmt if layer < dense else "4s")
            out.append(f if only is None or layer == only else None)
        return out

    variants = {"int4_now": (fmts(), "recent"), "int4_dense8": (fmts(int8=range(dense)), "recent"),
                "int4_dense_sub": (fmts(dense_fmt="4s"), "recent"), "int8_all": (fmts(all8=True), "recent"),
                "int4_now_hits": (fmts(), "hits")}
    for n in range(1, len(ranked) + 1):
        variants[f"top{n}_8"] = (fmts(int8=ranked[:n]), "recent")
    if args.per_layer:
        for layer in range(L):
            variants[f"only{layer}"] = (fmts(only=layer), "recent")

    def decode(token, t, ks, vs):
        cache = DynamicCache(ddp_cache_data=[(torch.from_numpy(np.ascontiguousarray(a, np.float32))[None],
                                              torch.from_numpy(np.ascontiguousarray(b, np.float32))[None])
                                             for a, b in zip(ks, vs)], config=src.model.config)
        with torch.no_grad():
            out = src.model(torch.tensor([[token]]), position_ids=torch.tensor([[t]]), use_cache=True,
                            **{src._cache_kwarg: cache})
        return log_softmax(out.logits[0, -1].double().numpy())

    stats = {name: dict(kl=[], agree=[]) for name in variants}
    t0 = time.perf_counter()
    for name, ids in prompts:
        T = len(ids)
        (q, k, v), _ = src._capture(ids)
        rt = [round_trips(k[layer], v[layer], ps, sub) for layer in range(L)]
        positions = list(range(T - args.positions, T))
        hits = replay_selection(q, k, positions, ps, 1024, schema.OpAttributes()).sum(axis=(0, 1, 2))
        for t in positions:
            n_full, n = t // ps, -(-t // ps)
            protected = {0, n - 1, n - 2}
            eligible = [j for j in range(n_full) if j not in protected]
            extra = max(0, math.ceil(args.hot * n) - len(protected))
            hot = {"recent": set(sorted(eligible)[-extra:]) if extra else set(),
                   "hits": set(sorted(eligible, key=lambda j: (-hits[j], -j))[:extra])}
            base = decode(ids[t], t, [k[layer][:, :t] for layer in range(L)], [v[layer][:, :t] for layer in range(L)])
            p = np.exp(base)
            for var, (formats, choice) in variants.items():
                cold = np.zeros(t, bool)
                for j in eligible:
                    if j not in hot[choice]:
                        cold[j * ps:(j + 1) * ps] = True
                ks, vs = [], []
                for layer, f in enumerate(formats):
                    kl_, vl_ = k[layer][:, :t], v[layer][:, :t]
                    if f is not None:
                        kq = rt[layer]["k8" if f == "8" else "k" + f][:, :t]
                        vq = rt[layer]["v8" if f == "8" else "v4"][:, :t]
                        w = kq.shape[1]  # full pages only; later tokens are never cold
                        kl_, vl_ = kl_.copy(), vl_.copy()
                        kl_[:, :w] = np.where(cold[None, :w, None], kq, kl_[:, :w])
                        vl_[:, :w] = np.where(cold[None, :w, None], vq, vl_[:, :w])
                    ks.append(kl_)
                    vs.append(vl_)
                lo = decode(ids[t], t, ks, vs)
                stats[var]["kl"].append(float((p * (base - lo)).sum()))
                stats[var]["agree"].append(float(base.argmax() == lo.argmax()))
        print(f"{name}: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    rows = {var: dict(kl=float(np.mean(s["kl"])), agree=float(np.mean(s["agree"])), n=len(s["kl"]))
            for var, s in stats.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(prompts=[p[0] for p in prompts], hot=args.hot, positions=args.positions,
                                        rows=rows, command=" ".join(sys.argv)), indent=1))
    for var, r in rows.items():
        print(f"| {var} | {r['kl']:.2e} | {r['agree']:.4f} | {r['n']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
