"""Write a tinyserve model package: model, manifest, tokenizer files - atomically.

Everything goes into a temporary sibling directory that is renamed into place
at the end, so a failed export never leaves a partial OUTDIR.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import onnx

MANIFEST = "tinyserve.json"
MODEL_FILE = "model.onnx"
EXTERNAL_DATA_OVER = 256 << 20  # bytes of weights above which they go to model.onnx.data
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


def write_package(outdir: Path, model: onnx.ModelProto, manifest: dict, extra_files: list[Path],
                  overwrite: bool = False, finalize=None) -> int:
    """Write and return the package's size in bytes."""
    outdir = Path(outdir)
    if outdir.exists() and not overwrite:
        raise FileExistsError(f"{outdir} exists (use --force to replace it)")
    outdir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{outdir.name}.", dir=outdir.parent))
    try:
        big = model.ByteSize() > EXTERNAL_DATA_OVER
        onnx.save_model(model, str(tmp / MODEL_FILE), save_as_external_data=big, all_tensors_to_one_file=True,
                        location=MODEL_FILE + ".data", size_threshold=1024)
        for f in extra_files:
            shutil.copy2(f, tmp / f.name)
        if finalize is not None:  # e.g. build a TensorRT engine next to the model
            finalize(tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        size = sum(p.stat().st_size for p in tmp.iterdir())
        if outdir.exists():
            shutil.rmtree(outdir)
        tmp.rename(outdir)
        return size
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
