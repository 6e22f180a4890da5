"""Microbenchmark of a decode step's bound update: ``append_bounds_numpy`` vs the native function.

SmolLM2 shapes by default (30 layers, 3 KV heads, head dim 64, page 32 / sub-page 4, float32
pool): ``--batch`` tokens appended to distinct pages whose valid counts are drawn uniformly in
``[0, ps)`` (fresh pages, young pages that move many channels, old ones that move few). Each
round restores the touched pages, then times both functions interleaved on their own copies and
checks min, max and codes equal bit for bit. Prints (and with ``--out`` writes) a markdown table:
median ms per call and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tinyserve_trt.cpu import append as native_append  # noqa: E402
from tinyserve_trt.ops.fine_bounds import pages_sub_bounds  # noqa: E402
from tinyserve_trt.runtime.append_bounds import append_bounds_numpy  # noqa: E402


def make_pool(rng, layers, pages, heads, ps, d, sp):
    """A pool whose pages hold ``valid`` tokens each, bounds and codes computed from scratch."""
    keys = (rng.standard_normal((layers, pages, heads, ps, d)) * (1 + 3 * (rng.random(d) < 0.2))).astype(np.float32)
    valid = rng.integers(0, ps, pages)
    kmin = np.zeros((layers, pages, heads, d), np.float32)
    kmax = np.zeros_like(kmin)
    sub = np.zeros((layers, pages, heads, ps // sp, d), np.uint8)
    for p in np.flatnonzero(valid):
        n = int(valid[p])
        kmin[:, p], kmax[:, p] = keys[:, p, :, :n].min(axis=2), keys[:, p, :, :n].max(axis=2)
        sub[:, p] = pages_sub_bounds(keys[:, p], sp, kmin[:, p], kmax[:, p], np.full(layers, n))
    return [keys, kmin, kmax, sub], valid


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--sub-page-size", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.batch > a.pages or a.page_size % a.sub_page_size:
        print("need --batch <= --pages and --sub-page-size dividing --page-size", file=sys.stderr)
        return 2
    reason = native_append.available()
    if reason:
        print(f"native library unavailable: {reason}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    base, valid = make_pool(rng, a.layers, a.pages, a.kv_heads, a.page_size, a.head_dim, a.sub_page_size)
    ref, nat = [x.copy() for x in base], [x.copy() for x in base]
    times = {"numpy": [], "native": []}
    for i in range(a.rounds):
        page = rng.choice(a.pages, a.batch, replace=False)
        off = valid[page]
        k = rng.standard_normal((a.layers, a.batch, a.kv_heads, a.head_dim)).astype(np.float32)
        for arrs in (ref, nat):
            for x, b in zip(arrs, base):
                x[:, page] = b[:, page]
            arrs[0][:, page, :, off, :] = np.swapaxes(k, 0, 1)
        order = [("numpy", append_bounds_numpy, ref), ("native", native_append.append_bounds, nat)]
        for name, fn, arrs in order if i % 2 else order[::-1]:
            t0 = time.perf_counter()
            fn(*arrs, page, off, k)
            times[name].append(time.perf_counter() - t0)
        if not all(np.array_equal(x[:, page], y[:, page]) for x, y in zip(ref[1:], nat[1:])):
            print(f"round {i}: native and numpy bounds differ", file=sys.stderr)
            return 1
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    table = "\n".join([
        f"append_bounds: L={a.layers} Hkv={a.kv_heads} D={a.head_dim} ps={a.page_size} sp={a.sub_page_size} "
        f"batch={a.batch}, float32, {a.rounds} rounds (median), outputs equal bit for bit",
        "", "| path | ms per call |", "|---|---|",
        *(f"| {n} | {m:.3f} |" for n, m in med.items()),
        f"| numpy / native | {med['numpy'] / med['native']:.1f}x |", ""])
    print(table)
    if a.out:
        a.out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
