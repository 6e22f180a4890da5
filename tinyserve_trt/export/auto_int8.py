"""``--int8-layers auto``: an INT4 export picks its INT8 layers by measuring its own package (issue #17).

The default for an int4 cold tier without ``--calibration``. :func:`export_with_int8_pass`
writes the package with every layer INT4 (no validation, ORT backend) into a temporary
directory, runs the layer sensitivity pass on it through the runtime
(``calibration.int8_pick``: 2 pieces of the built-in text, up to 2048 tokens each, the next token
at each one's last 8, the format's default hot share, ``default_int8_layers_count(L)`` layers), then writes the real package with
those layers - validated as usual. The manifest's ``cold_tier.int8_layers_source`` says
``auto: layer sensitivity on the built-in text, 2 prompts`` and ``cold_tier.int8_layers_kl``
holds the per-layer KL; the summary's time line shows the pass as ``int8 layers``.
This is the one place export reaches into calibration (and through it the runtime): the
measurement needs the package it just wrote to run (``contracts.LAYERS``).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path

from .config import ExportConfig
from .errors import UnsupportedError


def export_with_int8_pass(source: Path, outdir: Path, config: ExportConfig, overwrite: bool, quiet: bool,
                          extra_manifest: dict | None, progress):
    """``export_model`` of ``config`` with ``int8_layers`` picked by the sensitivity pass;
    the report's ``seconds["int8 layers"]`` is the all-INT4 export plus the pass."""
    from ..calibration.int8_pick import PASS_POSITIONS, PASS_PROMPTS, PASS_TOKENS, pick_int8_layers  # noqa: PLC0415
    from .pipeline import export_model  # noqa: PLC0415

    t0 = time.perf_counter()
    progress("picking INT8 layers: writing the package with every layer INT4 (not validated)")
    with tempfile.TemporaryDirectory(prefix="tinyserve-int8-pass-") as tmp:
        probe = replace(config, int8_layers="none", validate=False, backend="ort")
        export_model(source, Path(tmp) / "pkg", probe, quiet=True)
        progress(f"picking INT8 layers: each layer's sensitivity to INT4 cold pages on {PASS_PROMPTS} prompts of "
                 f"up to {PASS_TOKENS} tokens of the built-in text (the next token at the last {PASS_POSITIONS} of each)")
        try:
            pick = pick_int8_layers(Path(tmp) / "pkg")
        except Exception as e:  # noqa: BLE001 - the runtime's failure, as one line
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UnsupportedError(f"picking INT8 layers failed on the all-INT4 package ({type(e).__name__}: "
                                   f"{first[:200]}); pass --int8-layers none, layer indices or --calibration") from None
    seconds = time.perf_counter() - t0
    progress(f"picking INT8 layers: {','.join(map(str, pick.layers)) or 'none'} ({pick.describe()}; {seconds:.1f}s)")
    report = export_model(source, outdir, config, overwrite=overwrite, quiet=quiet, extra_manifest=extra_manifest,
                          int8_pick=pick)
    report.seconds["int8 layers"] = seconds
    return report
