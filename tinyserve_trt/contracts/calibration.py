"""CalibrationArtifact: what observation learned, saved as ``NAME.json`` + ``NAME.npz``.

The JSON holds the settings and the report (human-readable, diffable); the
``.npz`` beside it holds the per layer / KV head ranges. A contract of three
parties: ``tinyserve-calibrate`` writes it, ``tinyserve-export --calibration``
reads it and copies it into the package, and the runtime only loads it and
turns it into its configs (:meth:`tier_config`, :meth:`hotness_config`,
:meth:`static_scales`); it never observes (gpt-fast ``quantize.py``:
``create_quantized_state_dict`` writes, ``convert_for_runtime`` applies).
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tinyserve_trt.contracts.cold_tier import HotnessConfig, TierConfig, check_int8_layers
from tinyserve_trt.contracts.package_paths import resolve_inside
from tinyserve_trt.ops.quantization import GRANULARITIES, QMAX, group_scale

VERSION = 1


class ArtifactError(ValueError):
    """A calibration file that is missing, malformed or of another version."""


@dataclass(frozen=True, eq=False)
class CalibrationArtifact:
    """model: the calibrated model directory (informational).
    page_size, policy, token_budget: the op settings observed under.
    sink_pages, recent_pages: leading / trailing pages of every sequence kept hot.
    k_granularity / v_granularity: cold-page scale granularity to use.
    hot_fraction: share of live pages to keep hot.
    k_absmax: ``[L, Hkv, D]`` float32 max |key| per channel over the calibration prompts.
    v_absmax: ``[L, Hkv]`` float32 max |value|.
    hit_stats: share of decode-step page hits on sinks / recent pages / the rest, and how
               concentrated the rest is (``top10_share``: hits on its 10% most-hit pages).
    evaluation: held-out report (``memory_saved``, ``top1_agreement``, ``mean_kl``, ...).
    layer_kl: INT4 layer sensitivity (``calibration.sensitivity``): per layer, the mean
              KL(all hot || only this layer's cold pages INT4) on the held-out prompts; [] when not run.
    int8_layers: the layers an INT4 package keeps at INT8 (the most sensitive ones), which
                 ``tinyserve-export --calibration`` applies; None when the artifact names none.
    """

    model: str
    page_size: int
    k_granularity: str
    v_granularity: str
    hot_fraction: float
    k_absmax: np.ndarray
    v_absmax: np.ndarray
    policy: str = "query_aware"
    token_budget: int = 256
    sink_pages: int = 1
    recent_pages: int = 1
    num_prompts: int = 0
    hit_stats: dict = field(default_factory=dict)
    evaluation: dict = field(default_factory=dict)
    layer_kl: list = field(default_factory=list)
    int8_layers: list | None = None
    version: int = VERSION

    def __post_init__(self):
        for name in ("k_granularity", "v_granularity"):
            if getattr(self, name) not in GRANULARITIES:
                raise ArtifactError(f"{name} must be one of {GRANULARITIES}, got {getattr(self, name)!r}")
        if not 0.0 <= self.hot_fraction <= 1.0:
            raise ArtifactError(f"hot_fraction must be in [0, 1], got {self.hot_fraction!r}")
        if self.k_absmax.ndim != 3 or self.v_absmax.ndim != 2 or self.k_absmax.shape[:2] != self.v_absmax.shape:
            raise ArtifactError(f"k_absmax must be [L, Hkv, D] and v_absmax [L, Hkv], got "
                                f"{self.k_absmax.shape} and {self.v_absmax.shape}")
        L = self.k_absmax.shape[0]
        if self.layer_kl and len(self.layer_kl) != L:
            raise ArtifactError(f"layer_kl has {len(self.layer_kl)} entries for {L} layers")
        if self.int8_layers is not None:
            try:
                layers = check_int8_layers(self.int8_layers, "int4")
            except ValueError as e:
                raise ArtifactError(str(e)) from None
            if any(i >= L for i in layers):
                raise ArtifactError(f"int8_layers {list(layers)} out of range for {L} layers")
            object.__setattr__(self, "int8_layers", list(layers))

    # ---- files --------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write ``path`` (JSON) and its ``.npz`` sidecar; returns the JSON path."""
        path = Path(path)
        arrays = path.with_suffix(".npz")
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {k: v for k, v in asdict(self).items() if k not in ("k_absmax", "v_absmax")}
        meta["arrays"] = arrays.name
        np.savez(arrays, k_absmax=self.k_absmax.astype(np.float32), v_absmax=self.v_absmax.astype(np.float32))
        path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> CalibrationArtifact:
        """Read an artifact; ArtifactError naming the problem if it is not a valid one. Its
        ``arrays`` (the ``.npz``) must be a file in the JSON's folder (``package_paths``)."""
        path = Path(path)
        try:
            meta = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ArtifactError(f"cannot read calibration file {path}: {e}") from None
        if not isinstance(meta, dict) or meta.get("version") != VERSION:
            raise ArtifactError(f"{path} is not a version-{VERSION} calibration file")
        arrays = resolve_inside(path.parent, meta.pop("arrays", None), f"{path}: arrays", ArtifactError)
        try:
            with np.load(arrays, allow_pickle=False) as z:
                arrays = {k: z[k] for k in ("k_absmax", "v_absmax")}
            return cls(**meta, **arrays)
        except ArtifactError:
            raise
        except (OSError, KeyError, TypeError, ValueError, zipfile.BadZipFile) as e:
            raise ArtifactError(f"{path}: incomplete calibration artifact ({e})") from None

    # ---- apply ----------------------------------------------------------------
    def tier_config(self, num_cold_pages: int) -> TierConfig:
        """The cold pool's :class:`TierConfig` with these granularities."""
        return TierConfig(num_cold_pages=num_cold_pages, k_granularity=self.k_granularity,
                          v_granularity=self.v_granularity)

    def hotness_config(self, **overrides) -> HotnessConfig:
        """The :class:`HotnessConfig` for this calibration."""
        kw = dict(hot_fraction=self.hot_fraction, sink_pages=self.sink_pages, recent_pages=self.recent_pages)
        kw.update(overrides)
        return HotnessConfig(**kw)

    def static_scales(self) -> tuple[np.ndarray, np.ndarray]:
        """Static per (layer, KV head, channel) key and per (layer, KV head) value scales,
        ``[L, Hkv, 1, D]`` and ``[L, Hkv, 1, 1]`` float32 (the pool uses dynamic scales today)."""
        k = group_scale(self.k_absmax, QMAX)[:, :, None, :]
        v = group_scale(self.v_absmax, QMAX)[:, :, None, None]
        return k, v
