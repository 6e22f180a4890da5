"""``tinyserve-calibrate MODEL [--data FILE] [--samples N] [-o calibration.json]``.

Reads prompts (JSON Lines with a ``text`` or ``prompt`` field, or plain text
with one prompt per non-empty line; without ``--data`` the built-in text,
this project's documentation cut into ~2K-token pieces), observes the first
``--samples`` of them, evaluates on the next ``--heldout``, and writes the artifact
(``-o`` JSON + ``.npz`` beside it). MODEL is a tinyserve package (observed
through the runtime: the ``engine`` source) or a Hugging Face model directory
(torch: ``hf``); ``--source`` forces one. Exit 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields, replace
from pathlib import Path

from tinyserve_trt.calibration.default_text import NAME, default_prompts
from tinyserve_trt.calibration.observe import CalibrationConfig, calibrate
from tinyserve_trt.contracts.cold_tier import DEFAULT_HOT_FRACTION
from tinyserve_trt.calibration.source import detect_source, make_source, source_names

_DEFAULTS = {f.name: f.default for f in fields(CalibrationConfig)}


class DataError(ValueError):
    """A prompts file that cannot be used."""


def read_prompts(path: str | Path) -> list[str]:
    """Prompts of a ``.jsonl`` (``text``/``prompt`` field) or plain-text file; DataError if unusable."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read data file {path}: {e.__class__.__name__}: {e}") from None
    lines = [ln for ln in raw.splitlines() if ln.strip()]
    if path.suffix in (".jsonl", ".json"):
        prompts = []
        for i, ln in enumerate(lines, 1):
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i}: not JSON ({e.msg})") from None
            text = obj.get("text", obj.get("prompt")) if isinstance(obj, dict) else None
            if not isinstance(text, str) or not text.strip():
                raise DataError(f"{path}:{i}: expected an object with a non-empty 'text' or 'prompt' string")
            prompts.append(text)
    else:
        prompts = lines
    if not prompts:
        raise DataError(f"{path} holds no prompts")
    return prompts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tinyserve-calibrate", description=__doc__.split("\n\n")[1].strip())
    p.add_argument("model_dir", metavar="MODEL",
                   help="a tinyserve package (tinyserve-export's output: observed through the runtime) or a "
                        "Hugging Face model directory (transformers, torch)")
    p.add_argument("--data", default=None, metavar="FILE",
                   help="prompts: .jsonl (text/prompt) or text lines. Default: the built-in text (tinyserve's own "
                        f"documentation in {len(default_prompts())} pieces of ~2K tokens; not your domain - "
                        "prefer your own prompts)")
    p.add_argument("--samples", type=int, default=None, metavar="N",
                   help="calibration prompts (default 16; with the built-in text, its pieces left after --heldout)")
    p.add_argument("--heldout", type=int, default=4, metavar="N", help="held-out prompts for the report (default 4)")
    p.add_argument("-o", "--output", default="calibration.json", help="artifact path (default calibration.json)")
    p.add_argument("--page-size", type=int, default=None,
                   help=f"a package's own (fixed at export); HF default {_DEFAULTS['page_size']}")
    p.add_argument("--token-budget", type=int, default=None,
                   help=f"decode budget observed under (default: a package's, HF {_DEFAULTS['token_budget']})")
    p.add_argument("--decode-steps", type=int, default=_DEFAULTS["decode_steps"])
    p.add_argument("--hot-fraction", type=float, default=None,
                   help="share of pages kept hot in the evaluation and the artifact (default: the cold "
                        f"format's, {DEFAULT_HOT_FRACTION})")
    p.add_argument("--k-granularity", default=_DEFAULTS["k_granularity"])
    p.add_argument("--v-granularity", default=_DEFAULTS["v_granularity"])
    p.add_argument("--max-tokens", type=int, default=_DEFAULTS["max_tokens"])
    p.add_argument("--cold-format", choices=("int8", "int4"), default=None,
                   help="cold-page codec the held-out evaluation fake-quantizes with (default: a package's own; "
                        f"HF: {_DEFAULTS['cold_format']}); int4 also runs the layer sensitivity pass")
    p.add_argument("--group-size", type=int, default=None,
                   help="int4 V channels per scale (default: a package's own; HF "
                        f"{_DEFAULTS['group_size']}, tinyserve-export's)")
    p.add_argument("--sub-page-size", type=int, default=None,
                   help="two-level sub-page tokens, 0 = single level (default: a package's own; HF "
                        f"{_DEFAULTS['sub_page_size']})")
    p.add_argument("--dense-layers", type=int, default=None,
                   help=f"leading dense layers (default: a package's own; HF {_DEFAULTS['dense_layers']})")
    p.add_argument("--int8-layers-count", type=int, default=_DEFAULTS["int8_layers_count"], metavar="N",
                   help="int4: keep the N layers most sensitive to INT4 cold pages at INT8 (0 = none, no pass; "
                        "default: 10%% of the layers, rounded up). The pass measures, per layer, the mean KL(all hot || only that "
                        "layer's cold pages INT4): L+1 forwards per prompt, so it runs on the --heldout prompts "
                        "only; the artifact records the per-layer KL and the list tinyserve-export --calibration "
                        "applies")
    p.add_argument("--source", default=None,
                   help="model runner (registry in calibration/source.py): engine for a package, hf for a Hugging "
                        "Face directory; default: picked from MODEL")
    p.add_argument("--threads", type=int, default=None, help="engine source: ONNX Runtime intra-op threads")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _progress(quiet: bool):
    if quiet:
        return lambda it, desc: it
    try:
        from tqdm import tqdm  # noqa: PLC0415
    except ImportError:
        return lambda it, desc: it
    return lambda it, desc: tqdm(it, desc=desc, unit="prompt", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    def fail(msg: str):
        parser.exit(2, f"tinyserve-calibrate: error: {msg}\n")

    if Path(args.output).suffix == ".npz":  # the JSON would be written over its own arrays
        fail(f"-o {args.output}: the artifact is NAME.json + NAME.npz beside it; give the .json path")
    try:
        prompts = read_prompts(args.data) if args.data is not None else default_prompts()
        if args.samples is None:
            args.samples = 16 if args.data is not None else max(len(prompts) - args.heldout, 1)
        if args.samples < 1 or args.heldout < 0:
            raise DataError("--samples must be >= 1 and --heldout >= 0")
        fixed = {k: v for k, v in (("page_size", args.page_size), ("token_budget", args.token_budget)) if v is not None}
        codec = {k: v for k, v in (("cold_format", args.cold_format), ("sub_page_size", args.sub_page_size),
                                   ("dense_layers", args.dense_layers)) if v is not None}
        if args.group_size is not None:
            codec["group_size"] = args.group_size
        elif args.cold_format == "int8":  # INT8 scales take no channel groups
            codec["group_size"] = 0
        cfg = CalibrationConfig(decode_steps=args.decode_steps, hot_fraction=args.hot_fraction,
                                k_granularity=args.k_granularity, v_granularity=args.v_granularity,
                                max_tokens=args.max_tokens, int8_layers_count=args.int8_layers_count,
                                **fixed, **codec)
        if args.source is not None and args.source not in source_names():
            raise ValueError(f"unknown calibration source {args.source!r}; choose from {source_names()}")
        if len(prompts) < args.samples + args.heldout:
            raise DataError(f"{args.data or NAME} holds {len(prompts)} prompts; --samples {args.samples} + "
                            f"--heldout {args.heldout} needed")
        kind = detect_source(args.model_dir) if args.source is None else args.source
    except ValueError as e:
        fail(str(e))

    options = dict(fixed, decode_steps=cfg.decode_steps)
    if kind == "engine" and args.threads is not None:
        options["threads"] = args.threads
    if kind == "hf":  # replayed selection: two-level and dense layers as the package's op would run
        options.update(sub_page_size=cfg.sub_page_size, dense_layers=cfg.dense_layers,
                       group_reduce=cfg.group_reduce, candidate_share=cfg.candidate_share)
    try:
        source = make_source(kind, args.model_dir, **options)
        # the op settings the source observes under (a package's are fixed at export)
        settings = source.op_settings()
        cfg = replace(cfg, **settings, hot_recent_pages=max(cfg.hot_recent_pages, settings.get("recent_pages", 1)))
    except (OSError, ValueError, RuntimeError) as e:  # not a model directory / package, unknown source
        fail(f"cannot load {args.model_dir} ({kind} source): {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    try:
        # the engine runs a request two tokens past its prompt (the held-out tail's last step): leave them
        limit = min(cfg.max_tokens, source.max_context - 2 if source.max_context else cfg.max_tokens)
        ids = [source.tokenize(t)[:limit] for t in prompts[: args.samples + args.heldout]]
    except (OSError, ValueError) as e:  # e.g. a package without tokenizer.json
        fail(f"cannot tokenize the prompts: {str(e).splitlines()[0]}")
    short = [i for i, x in enumerate(ids) if len(x) < 2]
    if short:
        fail(f"prompt {short[0] + 1} has fewer than 2 tokens")
    artifact = calibrate(source, ids[: args.samples], ids[args.samples:], cfg, model=str(args.model_dir),
                         progress=_progress(args.quiet))
    path = artifact.save(args.output)
    ev = artifact.evaluation
    print(f"wrote {path} (+ {path.with_suffix('.npz').name}; {kind} source, page size {cfg.page_size}, "
          f"token budget {cfg.token_budget})")
    if artifact.layer_kl:
        kl = ", ".join(f"{i}: {x:.2e}" for i, x in enumerate(artifact.layer_kl))
        print(f"layer sensitivity (mean KL, only that layer INT4): {kl}; int8 layers {artifact.int8_layers}")
    if ev:
        print(f"held-out {ev['num_prompts']} prompts: {ev['cold_page_share']:.0%} of pages cold, "
              f"KV memory saved {ev['memory_saved']:.1%}, top-1 agreement {ev['top1_agreement']:.1%}, "
              f"mean KL {ev['mean_kl']:.2e} (max {ev['max_kl']:.2e}) vs all-hot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
