"""Validate the CUDA decode kernels at serving sizes, then time them against torch SDPA.

Grid: batch {1, 8, 32} x GQA group {1, 4} x context {1K, 8K, 32K} x budget
{512, 2048, dense}; fp16, D=128, 8 KV heads, page size 16, sequences of
different lengths (context minus a per-sequence offset, so last pages are partial).

References (the numpy one is too slow for every sequence at 32K x 32):
* numpy ``sparse_attention_ref`` (float64) on a subsample: the first and last
  sequence of every configuration, all their heads - selection by reference
  scores, output against the reference's attention over the kept pages;
* torch on the GPU for every sequence when the budget is dense: fp32 softmax
  attention over the sequence's gathered K/V plus its new token.
Mixed hot + INT8 and hot + INT4 cold pages (K per channel, V per token; half the pages cold):
decode at a sparse and a dense budget and a 4-token prefill, 4 sequences up to
2K tokens, every sequence against the numpy reference (which dequantizes cold
pages itself) and against the reference on the dequantized all-hot cache.
A few seconds; it runs first so a cold-path failure is reported before the grid.
Two-level selection (sub_page_size 4, candidate_share 0.5; sequences up to 8K, GQA 4,
budgets one sub-page / 1024 (emulated: 64) / dense, hot and hot + INT8 cold): the kernel's kept
sub-pages (read from its workspace) against ``ops.two_level`` by the reference's
sub-page scores, and the output against the reference's attention over exactly
those sub-pages, on every sequence.
Timing: decode at 32K, budget 2048 (and dense) vs torch
``scaled_dot_product_attention`` on contiguous [B, H, 32K, D] K/V, CUDA-event
medians; GB/s on the bytes our kernels actually load (kept K/V rows + page
metadata) vs a measured device-to-device copy bandwidth.
Two-level timing: decode at 8K, budget 1024, single-level vs two-level (random
fine codes: timing only) at each batch and group of the grid.
The checks live in ``gpu_check_grid.py``; this script times and reports.
Writes a markdown table to --out (default benchmarks/results/gpu_<gpu>.md). Fails
loudly (non-zero exit) on any mismatch.

``--emulated`` (what gpu_check.sh passes without a GPU): the CPU-emulated kernel
library on host tensors, a small grid (the emulator plays every CUDA thread on a
host thread), and no timing at all - the report says so.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_check_grid import (HKV, MIXED_LENS, PS, SP, TWO_LEVEL_ATTRS, TWO_LEVEL_LENS, D,  # noqa: E402
                            check_mixed, check_numpy, check_torch_dense, check_two_level, log, make_gpu_case)
from tinyserve_dev.kernels.harness import ForwardCall  # noqa: E402
from tinyserve_trt.ops import schema  # noqa: E402


def time_two_level(torch, B, G, reps, budget=1024, ctx=8192, seed=99):
    """Decode at ctx: single-level vs two-level at the same budget (random fine codes: timing only)."""
    case = make_gpu_case(torch, B, G, ctx, budget, seed)  # timing: on the GPU only
    P = case["key_cache"].shape[0]
    g = torch.Generator(device="cuda").manual_seed(seed)
    case["key_sub_bounds"] = torch.randint(0, 256, (P, HKV, PS // SP, D), device="cuda", generator=g,
                                           dtype=torch.uint8)
    single = ForwardCall(**case, attrs=schema.OpAttributes(), poison=False)
    two = ForwardCall(**case, attrs=TWO_LEVEL_ATTRS, poison=False)
    t1, t2 = time_ms(torch, single.launch, reps), time_ms(torch, two.launch, reps)
    log(f"time two-level B={B} G={G} ctx={ctx} budget={budget}: single {t1:.3f} ms, two-level {t2:.3f} ms")
    return (B, G, ctx, budget, SP, t1, t2, t2 / t1)


def time_ms(torch, fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return float(np.median(times))


def copy_bandwidth(torch):
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(torch, lambda: dst.copy_(src), 20)
    return 2 * src.numel() / ms / 1e6  # read + write, GB/s


def report_name(device: str) -> str:
    """gpu_<gpu>.md: 'NVIDIA H200' -> gpu_h200.md, 'NVIDIA H100 80GB HBM3' -> gpu_h100_80gb_hbm3.md."""
    slug = "".join(c if c.isalnum() else "_" for c in device.lower().removeprefix("nvidia").strip()).strip("_")
    return f"gpu_{slug or 'unknown'}.md"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="report path (default benchmarks/results/gpu_<gpu>.md)")
    ap.add_argument("--emulated", action="store_true",
                    help="CPU-emulated kernel library ($TINYSERVE_QSA_LIB or the default emulated build): "
                         "small grid, correctness only, no timing")
    ap.add_argument("--batches", help="default 1,8,32 (emulated: 1,2)")
    ap.add_argument("--groups", default="1,4")
    ap.add_argument("--contexts", help="default 1024,8192,32768 (emulated: 160,400)")
    ap.add_argument("--budgets", help="0 = dense; default 512,2048,0 (emulated: 64,0)")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from tinyserve_trt.cuda import library

    device = "cpu" if args.emulated else "cuda"  # the emulated library keeps every buffer in host memory
    if args.emulated:
        lib = library.use(library.library_path() if library.LIB_ENV in os.environ
                          else library.EMULATED_LIB)
        if not library.is_emulated(lib):
            raise SystemExit(f"gpu_check: --emulated, but {library.library_path()} is not the emulated build")
        dev = "cpu-emulation"
        defaults = dict(batches="1,2", contexts="160,400", budgets="64,0")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device (run with --emulated for the CPU emulation)")
        dev = torch.cuda.get_device_name(0)
        defaults = dict(batches="1,8,32", contexts="1024,8192,32768", budgets="512,2048,0")
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / report_name(dev)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    log(f"device {dev}, torch {torch.__version__}")
    attrs = schema.OpAttributes()  # query_aware, 1 sink page, 1 recent page, max over the group
    mixed_lens, mixed_hkv = ((300, 517, 33), 2) if args.emulated else (MIXED_LENS, HKV)
    mixed = check_mixed(seed=1234, lens=mixed_lens, kv_heads=mixed_hkv)
    two_lens = (300, 517, 33) if args.emulated else TWO_LEVEL_LENS
    two_level = check_two_level(seed=4321, lens=two_lens, kv_heads=mixed_hkv,
                                budget_sparse=64 if args.emulated else 1024)
    sync = (lambda: None) if args.emulated else torch.cuda.synchronize
    rows, timing = [], []
    seed = 0
    for B in ints(args.batches):
        for G in ints(args.groups):
            for ctx in ints(args.contexts):
                seed += 1
                case = make_gpu_case(torch, B, G, ctx, 0, seed, device)
                for budget in ints(args.budgets):
                    case["token_budget"].fill_(budget)
                    call = ForwardCall(**case, attrs=attrs)
                    call.launch()
                    sync()
                    sel = call.selected
                    if bool(((sel != 0) & (sel != 1)).any()) or bool(torch.isnan(call.output).any()):
                        raise AssertionError(f"B={B} G={G} ctx={ctx} budget={budget}: unwritten output")
                    gaps = [check_numpy(case, call.output, sel, b, attrs) for b in sorted({0, B - 1})]
                    dense_err = check_torch_dense(torch, case, call.output) if budget == 0 else None
                    kept = sel.sum().item() / (B * HKV)
                    rows.append((B, G, ctx, budget or "dense", f"{kept:.0f}", f"{max(gaps):.1e}",
                                 "-" if dense_err is None else f"{dense_err:.1e}", "ok"))
                    log(f"ok B={B} G={G} ctx={ctx} budget={budget or 'dense'} pages kept/head={kept:.0f}")
                    if not args.emulated and ctx == max(ints(args.contexts)) and budget in (2048, 0):
                        timing.append(time_case(torch, F, case, attrs, B, G, ctx, budget, args.reps, call))
                    del call
                del case
                if not args.emulated:
                    torch.cuda.empty_cache()
    bw, two_timing = None, []
    if args.emulated:
        log("CPU emulation: correctness only, NO TIMING WAS TAKEN")
    else:
        two_timing = [time_two_level(torch, B, G, args.reps) for B in ints(args.batches) for G in ints(args.groups)]
        bw = copy_bandwidth(torch)
        log(f"device copy bandwidth {bw:.0f} GB/s")
    write_report(out, dev, torch.__version__, rows, timing, bw, mixed, mixed_lens, mixed_hkv,
                 (two_level, two_lens, two_timing))
    log(f"wrote {out}")


def time_case(torch, F, case, attrs, B, G, ctx, budget, reps, call):
    ours = time_ms(torch, call.launch, reps)
    # bytes our kernels load: kept K/V rows, page metadata of every valid page, queries (outputs are small)
    kept_pages = call.selected.sum().item()
    valid_pages = sum(-(-int(p) // PS) for p in case["past_lens"].tolist()) * HKV
    elt = 2
    bytes_loaded = kept_pages * PS * D * 2 * elt + valid_pages * D * 2 * elt + case["query"].numel() * elt
    # baseline: torch SDPA over contiguous K/V of the longest sequence, same heads
    H = HKV * G
    T = int(case["past_lens"].max()) + 1
    q = case["query"]
    k = torch.randn(B, HKV, T, D, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    try:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        how = "enable_gqa"
    except TypeError:  # torch < 2.5: expand K/V to every query head outside the timed region
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
        how = "repeated K/V"
    base = time_ms(torch, sdpa, reps)
    base_bytes = 2 * B * HKV * T * D * elt
    log(f"time B={B} G={G} budget={budget or 'dense'}: ours {ours:.3f} ms, sdpa {base:.3f} ms")
    return (B, G, ctx, budget or "dense", call.num_splits, ours, base, base / ours, bytes_loaded / ours / 1e6,
            base_bytes / base / 1e6, how, H)


def write_report(path, dev, torch_version, rows, timing, bw, mixed, mixed_lens=MIXED_LENS, mixed_hkv=HKV,
                 two_level=((), TWO_LEVEL_LENS, ())):
    L = [f"# QueryAwareSparseAttention CUDA kernels on {dev}", "",
         f"Written by `benchmarks/gpu_check.sh` (torch {torch_version}). fp16, D={D}, {HKV} KV heads, page size "
         f"{PS}, policy query_aware (1 sink + 1 recent page, group max).", "",
         "## Validation", "",
         "Numpy float64 reference on the first and last sequence of each configuration (selection by reference "
         "scores; output vs attention over the kept pages, fp16 tolerance 2e-3); torch fp32 attention on every "
         "sequence when dense.", "",
         "| batch | group | context | budget | pages kept / (seq, KV head) | score gap | dense excess err | |",
         "|---|---|---|---|---|---|---|---|"]
    L += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    L += ["", "### Hot + INT8 / INT4 cold pages", "",
          f"{len(mixed_lens)} sequences ({', '.join(map(str, mixed_lens))} tokens), {mixed_hkv * 4} query heads, "
          "half the pool pages cold (K scale per channel, V per token; INT4 packed two per byte, float16 "
          "scales, V in groups of 32 channels); every sequence vs the numpy reference on the dequantized cache, "
          "fp16 tolerance.", "",
          "| cold format | new tokens | budget | hot pages | cold pages | score gap | max abs err vs dequantized | |",
          "|---|---|---|---|---|---|---|---|"]
    L += ["| " + " | ".join(map(str, r)) + " |" for r in mixed]
    two_rows, two_lens, two_timing = two_level
    L += ["", "### Two-level selection", "",
          f"sub_page_size {SP}, candidate_share {TWO_LEVEL_ATTRS.candidate_share}; {len(two_lens)} sequences "
          f"({', '.join(map(str, two_lens))} tokens), {mixed_hkv * 4} query heads; every sequence's kept sub-pages "
          "vs `ops.two_level` by reference sub-page scores, output vs attention over those sub-pages "
          "(fp16 tolerance).", "",
          "| budget | pages | sub-pages kept / (seq, KV head) | score gap | max abs err | |",
          "|---|---|---|---|---|---|"]
    L += ["| " + " | ".join(map(str, r)) + " |" for r in two_rows]
    if two_timing:
        L += ["", "Two-level decode timing (median of CUDA-event runs; fine codes random, so which sub-pages are "
              "kept is arbitrary but their number is the budget's):", "",
              "| batch | group | context | budget | sub-page | single-level ms | two-level ms | two / single |",
              "|---|---|---|---|---|---|---|---|"]
        L += [f"| {B} | {G} | {ctx} | {budget} | {sp} | {t1:.3f} | {t2:.3f} | {ratio:.2f}x |"
              for (B, G, ctx, budget, sp, t1, t2, ratio) in two_timing]
    if bw is None:
        L += ["", "## Decode timing", "", "**No timing was taken**: this run used the CPU-emulated kernel library "
              "(plugins/emulation), which checks correctness only.", ""]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(L) + "\n")
        return
    L += ["", "## Decode timing (median of CUDA-event runs)", "",
          f"Device copy bandwidth (1 GiB D2D, read+write): **{bw:.0f} GB/s**. Ours = select + split-K attention + "
          "combine; GB/s counts the bytes the kernels must read (kept K/V rows + min/max of every page + queries) "
          "over the measured time, and the roofline column divides it by the copy bandwidth. SDPA = "
          "`torch.nn.functional.scaled_dot_product_attention` dense decode over contiguous K/V of the longest "
          "sequence.", "",
          "| batch | group | context | budget | splits | ours ms | SDPA ms | SDPA/ours | ours GB/s | SDPA GB/s | "
          "roofline: ours GB/s / copy BW | SDPA GQA |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (B, G, ctx, budget, splits, ours, base, ratio, gbs, base_gbs, how, _H) in timing:
        L.append(f"| {B} | {G} | {ctx} | {budget} | {splits} | {ours:.3f} | {base:.3f} | {ratio:.2f}x | "
                 f"{gbs:.0f} | {base_gbs:.0f} | {100 * gbs / bw:.0f}% | {how} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(L) + "\n")


if __name__ == "__main__":
    main()
