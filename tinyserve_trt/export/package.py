"""Write a tinyserve model package: model, manifest, tokenizer files - atomically.

Everything goes into a temporary sibling directory that is swapped into place
at the end (``outdir.py``), so a failed export never leaves a partial OUTDIR and
``--force`` replaces only a previous package. The weights go
to ``model.onnx.data`` (every initializer over 1 KiB, whatever the model's
size), the one copy that ``model.onnx``, ORT's optimized graph
(``ort_graph.py``) and the TensorRT parser all read. File names and the
manifest's format are ``contracts.manifest``'s.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import onnx

from ..contracts.manifest import MODEL_DATA_FILE, MODEL_FILE, Manifest
from .outdir import check_output, staging_dir, swap_in
from .weights import EXTERNAL_OVER, tensor_bytes, write_data

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json", "config.json", "vocab.json", "merges.txt")


def tokenizer_files(model_path: Path) -> list[Path]:
    return [model_path.parent / n for n in TOKENIZER_FILES if (model_path.parent / n).is_file()]


def special_tokens(files: list[Path]) -> dict:
    """bos/eos ids from config.json / generation_config.json, when present."""
    out = {}
    for f in files:
        if f.name in ("config.json", "generation_config.json"):
            try:
                data = json.loads(f.read_text())
            except json.JSONDecodeError:
                continue
            for key in ("bos_token_id", "eos_token_id"):
                if data.get(key) is not None:
                    out.setdefault(key, data[key])
    return out


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the model's initializers (what ``model.onnx.data`` holds, plus the small inline
    ones), read from the proto's records: no weight is loaded."""
    return sum(tensor_bytes(t) for t in model.graph.initializer)


def package_bytes(path: Path) -> int:
    """Bytes of every file in a package directory."""
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


class StagedPackage:
    """OUTDIR being built in a temporary sibling folder (``outdir.py``), swapped in by
    :meth:`commit`; leaving the ``with`` block by an exception removes it and touches nothing
    else. The model is written first (:meth:`write_model`), so validation sessions read the
    weights from the package's own data file."""

    def __init__(self, outdir: Path, overwrite: bool = False):
        self.outdir = Path(outdir)
        check_output(self.outdir, overwrite)
        self.path = staging_dir(self.outdir)

    def __enter__(self) -> "StagedPackage":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            shutil.rmtree(self.path, ignore_errors=True)

    def write_model(self, model: onnx.ModelProto, weights_dir: Path | None, on_bytes=None) -> int:
        """``model.onnx`` + ``model.onnx.data`` (every initializer over ``EXTERNAL_OVER`` bytes,
        streamed from ``weights_dir``, the folder its external references resolve in); ``model``
        is left pointing at the package's data file. Returns the weights' bytes."""
        weights = weight_bytes(model)
        write_data(model, Path(weights_dir or "."), self.path / MODEL_DATA_FILE, EXTERNAL_OVER, on_bytes=on_bytes)
        onnx.save_model(model, str(self.path / MODEL_FILE))
        return weights

    def commit(self, manifest: Manifest, extra_files: list[Path],
               finalize: Callable[[Path, Manifest], Manifest] | None = None) -> tuple[int, Manifest]:
        """Copy ``extra_files``, run ``finalize(folder, manifest)`` (e.g. the TensorRT engine or
        ORT's optimized graph next to the model), save the manifest, swap the folder in; returns
        the package's bytes and the manifest as written."""
        for f in extra_files:
            shutil.copy2(f, self.path / f.name)
        if finalize is not None:
            manifest = finalize(self.path, manifest)
        manifest.save(self.path)
        size = package_bytes(self.path)
        swap_in(self.path, self.outdir)
        return size, manifest


def write_package(outdir: Path, model: onnx.ModelProto, manifest: Manifest, extra_files: list[Path],
                  overwrite: bool = False, finalize: Callable[[Path, Manifest], Manifest] | None = None,
                  weights_dir: Path | None = None) -> tuple[int, Manifest]:
    """The whole package in one call (:class:`StagedPackage`); returns its size in bytes and
    the manifest as written. ``model``'s external weights resolve in ``weights_dir``."""
    with StagedPackage(outdir, overwrite) as stage:
        stage.write_model(model, weights_dir)
        return stage.commit(manifest, extra_files, finalize)
