"""``tinyserve-calibrate MODEL_DIR --data FILE [--samples N] [-o calibration.json]``.

Reads prompts (JSON Lines with a ``text`` or ``prompt`` field, or plain text
with one prompt per non-empty line), observes the first ``--samples`` of
them, evaluates on the next ``--heldout``, and writes the artifact
(``-o`` JSON + ``.npz`` beside it). Exit 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from tinyserve_trt.calibration.observe import CalibrationConfig, calibrate

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
    p.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face model directory (transformers)")
    p.add_argument("--data", required=True, metavar="FILE", help="prompts: .jsonl (text/prompt) or text lines")
    p.add_argument("--samples", type=int, default=16, metavar="N", help="calibration prompts (default 16)")
    p.add_argument("--heldout", type=int, default=4, metavar="N", help="held-out prompts for the report (default 4)")
    p.add_argument("-o", "--output", default="calibration.json", help="artifact path (default calibration.json)")
    p.add_argument("--page-size", type=int, default=_DEFAULTS["page_size"])
    p.add_argument("--token-budget", type=int, default=_DEFAULTS["token_budget"])
    p.add_argument("--decode-steps", type=int, default=_DEFAULTS["decode_steps"])
    p.add_argument("--hot-fraction", type=float, default=_DEFAULTS["hot_fraction"])
    p.add_argument("--k-granularity", default=_DEFAULTS["k_granularity"])
    p.add_argument("--v-granularity", default=_DEFAULTS["v_granularity"])
    p.add_argument("--max-tokens", type=int, default=_DEFAULTS["max_tokens"])
    p.add_argument("--source", default="hf", help="model runner (registry in calibration/source.py)")
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
    try:
        if args.samples < 1 or args.heldout < 0:
            raise DataError("--samples must be >= 1 and --heldout >= 0")
        cfg = CalibrationConfig(page_size=args.page_size, token_budget=args.token_budget,
                                decode_steps=args.decode_steps, hot_fraction=args.hot_fraction,
                                k_granularity=args.k_granularity, v_granularity=args.v_granularity,
                                max_tokens=args.max_tokens)
        prompts = read_prompts(args.data)
        if len(prompts) < args.samples + args.heldout:
            raise DataError(f"{args.data} holds {len(prompts)} prompts; --samples {args.samples} + "
                            f"--heldout {args.heldout} needed")
        if not Path(args.model_dir).is_dir():
            raise DataError(f"model directory {args.model_dir} does not exist")
    except ValueError as e:
        parser.exit(2, f"tinyserve-calibrate: error: {e}\n")

    from tinyserve_trt.calibration.source import make_source  # noqa: PLC0415 (imports torch)

    try:
        source = make_source(args.source, args.model_dir, page_size=cfg.page_size, token_budget=cfg.token_budget,
                             decode_steps=cfg.decode_steps)
    except (OSError, ValueError) as e:  # not a model directory, unknown source
        parser.exit(2, f"tinyserve-calibrate: error: cannot load {args.model_dir}: {str(e).splitlines()[0]}\n")
    ids = [source.tokenize(t)[: cfg.max_tokens] for t in prompts[: args.samples + args.heldout]]
    short = [i for i, x in enumerate(ids) if len(x) < 2]
    if short:
        parser.exit(2, f"tinyserve-calibrate: error: prompt {short[0] + 1} has fewer than 2 tokens\n")
    artifact = calibrate(source, ids[: args.samples], ids[args.samples:], cfg, model=str(args.model_dir),
                         progress=_progress(args.quiet))
    path = artifact.save(args.output)
    ev = artifact.evaluation
    print(f"wrote {path} (+ {path.with_suffix('.npz').name})")
    if ev:
        print(f"held-out {ev['num_prompts']} prompts: {ev['cold_page_share']:.0%} of pages cold, "
              f"KV memory saved {ev['memory_saved']:.1%}, top-1 agreement {ev['top1_agreement']:.1%}, "
              f"mean KL {ev['mean_kl']:.2e} (max {ev['max_kl']:.2e}) vs all-hot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
