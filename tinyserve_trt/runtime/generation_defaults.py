"""The package's sampling defaults, from the source model's ``generation_config.json``.

``tinyserve-export`` copies that file next to the tokenizer files when the source
Hugging Face directory has one. Read with Hugging Face's rules: without
``do_sample: true`` a model generates greedily (temperature, top-p and top-k are
then ignored; ``repetition_penalty`` still applies); with it, a missing ``top_k``
means 50. A package without the file generates greedily, so the README's first
command gives the model's most likely answer rather than a random draw.

What a caller sets explicitly (a CLI flag, a request field, a ``SamplingParams``
given to ``LLM``) always wins over these defaults.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from tinyserve_trt.runtime.sampling import SamplingParams

GENERATION_CONFIG = "generation_config.json"
HF_TOP_K = 50  # transformers' GenerationConfig default when do_sample is on


def sampling_defaults(package_dir: str | Path) -> dict:
    """SamplingParams keyword arguments the package's generation config implies.

    ``{"temperature": 0.0}`` (greedy) when the package has no generation config or it
    does not sample. ValueError (one line, naming the file) for a malformed file.
    """
    path = Path(package_dir) / GENERATION_CONFIG
    if not path.is_file():
        return {"temperature": 0.0}
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object")
    out: dict = {}
    if cfg.get("repetition_penalty") is not None:
        out["repetition_penalty"] = cfg["repetition_penalty"]
    if cfg.get("do_sample") is not True:
        return {"temperature": 0.0, **out}
    out["temperature"] = cfg.get("temperature", 1.0)
    out["top_p"] = cfg.get("top_p", 1.0)
    top_k = cfg.get("top_k", HF_TOP_K)
    out["top_k"] = 0 if top_k is None else top_k
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return out


def default_params(package_dir: str | Path, **explicit) -> SamplingParams:
    """SamplingParams from the package's defaults, with ``explicit`` fields (those not None) on top."""
    base = SamplingParams(**sampling_defaults(package_dir))
    return replace(base, **{k: v for k, v in explicit.items() if v is not None})
