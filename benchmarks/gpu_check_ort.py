"""GPU check: the ORT backend on the CUDA EP (pages on the GPU) against the CPU EP.

    python3 benchmarks/gpu_check_ort.py [--model PKG] [--provider cuda|tensorrt] [--steps 16]

Checks, printing each: onnxruntime-gpu is importable and offers the EP, torch sees a
GPU (else: "skipped: ..." and exit 0); a package (--model, or a tiny random LLaMA
built here when torch + transformers are present); greedy decode of the same prompt
on the CPU EP and on the GPU EP gives the same token ids; the GPU run's transfer
counter: bytes host -> device and device -> host per decode step, which must stay a
small fraction of the KV pool (the pool never crosses). Exit 1 when a check fails.
No timings: this is a correctness check.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def log(msg: str) -> None:
    print(f"[gpu_check_ort] {msg}", flush=True)


def gpu_ready(provider: str) -> str | None:
    """None when the EP can run here, else why not."""
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime-gpu not importable"
    ep = {"cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}[provider]
    if ep not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} has no {ep} (onnxruntime-gpu not installed?)"
    try:
        import torch
    except ImportError:
        return "torch not importable (the GPU pages are torch tensors)"
    if not torch.cuda.is_available():
        return "no GPU visible to torch"
    return None


def package_dir(model: str | None, tmp: Path) -> Path | None:
    if model:
        return Path(model)
    try:
        import transformers  # noqa: F401

        from tests.tiny_models import build_package
    except ImportError as e:
        log(f"no --model and cannot build a tiny one ({e})")
        return None
    log("building a tiny random LLaMA package (tests/tiny_models.py)")
    return build_package("llama", tmp)[1]


def greedy(pkg: Path, provider: str, prompt: list[int], steps: int) -> tuple[list[int], dict, list[dict]]:
    """Token ids, final engine stats (+ the device pool's bytes) and per-step stats of one greedy run."""
    from tinyserve_trt.runtime.llm import LLM
    from tinyserve_trt.runtime.sampling import SamplingParams

    # sparse_min_ratio 0: the short check prompt decodes sparse (the op's selection on the GPU EP)
    llm = LLM(pkg, ort_provider=provider, max_batch=1, max_seq_len=len(prompt) + steps + 8, sparse_min_ratio=0)
    engine = llm.engine
    seq = engine.add_request("check", prompt, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    per_step = []
    while engine.has_unfinished():
        engine.step()
        per_step.append(engine.stats())
    stats = dict(per_step[-1])
    device = getattr(engine.backend, "_device", None)  # ort_binding.DeviceBinding on a GPU EP
    layers = device.pages.layers if device is not None else []
    stats["pool_bytes_on_device"] = sum(t.numel() * t.element_size() for layer in layers for t in layer.values())
    ids = list(seq.output_token_ids)
    llm.close()
    return ids, stats, per_step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="package directory (default: build a tiny one)")
    ap.add_argument("--provider", choices=("cuda", "tensorrt"), default="cuda")
    ap.add_argument("--steps", type=int, default=16, help="decode steps")
    ap.add_argument("--prompt-len", type=int, default=24)
    args = ap.parse_args(argv)
    why = gpu_ready(args.provider)
    if why:
        print(f"gpu_check_ort: skipped: {why}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        pkg = package_dir(args.model, Path(tmp))
        if pkg is None:
            print("gpu_check_ort: skipped: no package (pass --model PKG, or install torch + transformers)")
            return 0
        prompt = [(7 * i) % 97 + 3 for i in range(args.prompt_len)]
        log(f"package {pkg}; prompt {len(prompt)} tokens; {args.steps} greedy steps")
        cpu_ids, cpu_stats, _ = greedy(pkg, "cpu", prompt, args.steps)
        log(f"CPU EP ids  {cpu_ids}")
        gpu_ids, gpu_stats, per_step = greedy(pkg, args.provider, prompt, args.steps)
        log(f"{args.provider} EP ids {gpu_ids}")
    failures = []
    if gpu_ids != cpu_ids:
        first = next((i for i, (a, b) in enumerate(zip(cpu_ids, gpu_ids)) if a != b), min(len(cpu_ids), len(gpu_ids)))
        failures.append(f"greedy ids differ from the CPU EP at token {first}")
    else:
        log("check: greedy ids equal on both EPs: ok")
    keys = ("transfer_device", "transfer_h2d_bytes", "transfer_d2h_bytes", "transfer_h2d_bytes_last_step",
            "transfer_d2h_bytes_last_step", "pool_bytes_on_device")
    log("CPU EP transfers: " + ", ".join(f"{k}={cpu_stats.get(k)}" for k in keys))
    log(f"{args.provider} EP transfers: " + ", ".join(f"{k}={gpu_stats.get(k)}" for k in keys))
    for i, s in enumerate(per_step):
        log(f"  step {i}: h2d {s['transfer_h2d_bytes_last_step']} B, d2h {s['transfer_d2h_bytes_last_step']} B")
    if gpu_stats.get("transfer_device") != "cuda":
        failures.append(f"the {args.provider} run kept its pages on {gpu_stats.get('transfer_device')}")
    pool = gpu_stats["pool_bytes_on_device"]
    last = gpu_stats.get("transfer_h2d_bytes_last_step", 0) + gpu_stats.get("transfer_d2h_bytes_last_step", 0)
    if pool and last * 20 > pool:
        failures.append(f"a decode step moved {last} B, more than 5% of the {pool} B KV pool")
    elif pool:
        log(f"check: last decode step moved {last} B vs a {pool} B pool on the device: ok")
    if cpu_stats.get("transfer_h2d_bytes") or cpu_stats.get("transfer_d2h_bytes"):
        failures.append("the CPU EP reported device transfers")
    for f in failures:
        print(f"gpu_check_ort: FAIL: {f}")
    print("gpu_check_ort: " + ("FAILED" if failures else "passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
