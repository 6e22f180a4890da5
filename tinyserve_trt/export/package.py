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

EXTERNAL_OVER = 1024  # bytes; smaller initializers stay inline in the graph (as ORT does)
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
    """Bytes of the model's initializers (what ``model.onnx.data`` holds, plus the small inline ones)."""
    return sum(len(t.raw_data) or onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def package_bytes(path: Path) -> int:
    """Bytes of every file in a package directory."""
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


def write_package(outdir: Path, model: onnx.ModelProto, manifest: Manifest, extra_files: list[Path],
                  overwrite: bool = False,
                  finalize: Callable[[Path, Manifest], Manifest] | None = None) -> tuple[int, Manifest]:
    """Write the package; returns its size in bytes and the manifest as written.

    ``finalize(tmp, manifest)`` runs after the model is written (e.g. builds a TensorRT
    engine or ORT's optimized graph next to it) and returns the manifest to save.
    Moves ``model``'s initializers out to the data file (the proto is left without them).
    """
    outdir = Path(outdir)
    check_output(outdir, overwrite)
    tmp = staging_dir(outdir)
    try:
        onnx.save_model(model, str(tmp / MODEL_FILE), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=MODEL_DATA_FILE, size_threshold=EXTERNAL_OVER)
        for f in extra_files:
            shutil.copy2(f, tmp / f.name)
        if finalize is not None:
            manifest = finalize(tmp, manifest)
        manifest.save(tmp)
        size = package_bytes(tmp)
        swap_in(tmp, outdir)
        return size, manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
