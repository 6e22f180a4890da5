"""Pick an INT4 package's INT8 layers with no data of the user's (issue #17).

``tinyserve-export`` (``export/auto_int8.py``) writes the package with every layer INT4, then
calls :func:`pick_int8_layers` on it: the layer sensitivity pass (``sensitivity.py``) through the
package's own engine (``engine_source.py``) on ``num_prompts`` pieces of the built-in text
(``default_text.py``) of up to ``max_tokens`` tokens each (fewer when the package's max context
is shorter), the next token at each prompt's last ``PASS_POSITIONS`` tokens, the cold tier's
default hot share (``DEFAULT_HOT_FRACTION``); the ``default_int8_layers_count(L)`` layers of
largest KL are kept at INT8. Cost: one prefill and
``(L + 1) x PASS_POSITIONS`` decode steps per prompt (SmolLM2, 30 layers, 2 prompts of 2048
tokens: 366 s with the all-INT4 export on a loaded 2-core CPU; it picked 17,18,23, the benchmark's
layers 18, 23 and 17 - one position per prompt had picked 0,3,6).
When no prompt has a full cold page (a tiny max context), every KL is 0 and no layer is picked.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from tinyserve_trt.calibration.default_text import NAME, default_prompts
from tinyserve_trt.calibration.observe import CalibrationConfig
from tinyserve_trt.calibration.sensitivity import SENSITIVITY_POSITIONS as PASS_POSITIONS
from tinyserve_trt.calibration.sensitivity import layer_sensitivity, most_sensitive

PASS_PROMPTS = 2
PASS_TOKENS = 2048


@dataclass(frozen=True)
class Int8Pick:
    """The pass's result: ``layers`` (sorted), ``layer_kl`` (one mean KL per layer), what it ran on."""

    layers: tuple
    layer_kl: list
    num_prompts: int
    tokens: int  # per prompt (the longest)

    def describe(self) -> str:
        """``auto: layer sensitivity on the built-in text, 2 prompts`` (the summary's and manifest's)."""
        text = f"auto: layer sensitivity on {NAME}, {self.num_prompts} prompts"
        if not self.layers:
            text += f" of {self.tokens} tokens had no cold page: none"
        return text


def pass_config(source, max_tokens: int) -> CalibrationConfig:
    """The package's own op and codec settings (``EngineSource.op_settings``), the format's default hot share."""
    settings = source.op_settings()
    cfg = CalibrationConfig(max_tokens=max_tokens, cold_format=settings.get("cold_format", "int4"))
    return replace(cfg, **settings, hot_recent_pages=max(cfg.hot_recent_pages, settings.get("recent_pages", 1)))


def pass_prompts(source, num_prompts: int = PASS_PROMPTS, max_tokens: int = PASS_TOKENS) -> list[list[int]]:
    """The first ``num_prompts`` pieces of the built-in text as token ids, each cut to
    ``max_tokens`` and to what the package's max context holds."""
    if num_prompts < 1 or max_tokens < 2:
        raise ValueError(f"need >= 1 prompt of >= 2 tokens, got {num_prompts} of {max_tokens}")
    # the tail's request runs two tokens past the prompt (tail_logits_many keeps it unfinished)
    limit = min(max_tokens, source.max_context - 2 if source.max_context else max_tokens)
    return [source.tokenize(text)[:limit] for text in default_prompts()[:num_prompts]]


def pick_int8_layers(package_dir: str | Path, num_prompts: int = PASS_PROMPTS, max_tokens: int = PASS_TOKENS,
                     threads: int | None = None) -> Int8Pick:
    """Run the pass on the INT4 package ``package_dir`` (every layer INT4); ValueError when it is not one."""
    from tinyserve_trt.calibration.engine_source import EngineSource  # noqa: PLC0415 (the runtime)

    source = EngineSource(str(package_dir), threads=threads)
    cfg = pass_config(source, max_tokens)
    if cfg.cold_format != "int4":
        raise ValueError(f"{package_dir} has no int4 cold tier")
    prompts = pass_prompts(source, num_prompts, max_tokens)
    layer_kl = layer_sensitivity(source, prompts, cfg, positions=PASS_POSITIONS)
    measured = any(kl > 0 for kl in layer_kl)
    count = cfg.resolved_int8_layers_count(source.num_layers)
    layers = tuple(most_sensitive(layer_kl, count)) if measured else ()
    return Int8Pick(layers, [float(x) for x in layer_kl], len(prompts), max(len(p) for p in prompts))
