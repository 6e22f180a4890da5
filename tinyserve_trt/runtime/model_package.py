"""ModelPackage: a directory written by ``tinyserve-export``, loaded and checked.

A package holds ``model.onnx`` (+ ``model.onnx.data``), the ``tinyserve.json``
manifest (dims, paged I/O names, defaults) and the source's tokenizer files.
``ModelPackage.load`` checks what the runtime relies on and raises
``PackageError`` with one line naming the problem; it does not open the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

MANIFEST = "tinyserve.json"
MODEL_FILE = "model.onnx"
FORMAT = "tinyserve-package"
INPUT_ROLES = ("input_ids", "page_table", "past_lens", "token_budget")
LAYER_ROLES = ("key_cache", "value_cache", "key_min", "key_max", "new_key", "new_value")
COLD_ROLES = ("key_cache_int8", "value_cache_int8", "key_scale", "value_scale")  # ops.schema.COLD_INPUTS
COLD_TIER_FIELDS = ("k_granularity", "v_granularity", "hot_fraction", "sink_pages", "recent_pages", "decay")
SUB_ROLE = "key_sub_bounds"  # ops.schema.TWO_LEVEL_INPUTS: per sparse layer of a two-level package
INT_FIELDS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "page_size", "token_budget")


class PackageError(ValueError):
    """A package directory that is missing, incomplete or inconsistent."""


@dataclass(frozen=True)
class ModelPackage:
    """A validated package. Dims come from the manifest; I/O names from ``io``.

    inputs:  role -> model input name (``input_ids``, ``position_ids``, ``page_table``,
             ``past_lens``, ``token_budget``, ``logits_index`` when present).
    layers:  per layer, role -> name (``key_cache``, ``value_cache``, ``key_min``,
             ``key_max`` inputs; ``new_key``, ``new_value``, ``selected_pages`` outputs;
             with a cold tier also ``key_cache_int8``, ``value_cache_int8``, ``key_scale``,
             ``value_scale`` inputs).
    cold_tier: the INT8 cold tier's granularities and hot/cold policy parameters
             (``tinyserve-export --calibration``), None for a hot-only package.
    logits:  output name, ``[B, 1, V]`` with ``logits_index`` (else ``[B, S, V]``).
    """

    path: Path
    manifest: dict = field(repr=False)

    @classmethod
    def load(cls, path: str | Path) -> ModelPackage:
        path = Path(path)
        if not path.is_dir():
            raise PackageError(f"{path}: not a directory (expected a package written by tinyserve-export)")
        mpath = path / MANIFEST
        if not mpath.is_file():
            raise PackageError(f"{path}: no {MANIFEST} (not a tinyserve package; run tinyserve-export first)")
        try:
            manifest = json.loads(mpath.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PackageError(f"{mpath}: not valid JSON ({e})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise PackageError(f"{mpath}: format is not {FORMAT!r}")
        if not (path / MODEL_FILE).is_file():
            raise PackageError(f"{path}: {MODEL_FILE} is missing")
        for name in INT_FIELDS:
            value = manifest.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "token_budget" else 1):
                raise PackageError(f"{mpath}: field {name!r} must be a positive int, got {value!r}")
        io = manifest.get("io")
        if not isinstance(io, dict) or not isinstance(io.get("inputs"), dict) or not isinstance(io.get("layers"), list):
            raise PackageError(f"{mpath}: 'io' must hold 'inputs' and 'layers'")
        missing = [r for r in INPUT_ROLES if r not in io["inputs"]]
        if missing:
            raise PackageError(f"{mpath}: io.inputs lacks {missing}")
        if len(io["layers"]) != manifest["num_layers"]:
            raise PackageError(f"{mpath}: io.layers has {len(io['layers'])} entries for num_layers="
                               f"{manifest['num_layers']}")
        for i, layer in enumerate(io["layers"]):
            lacking = [r for r in LAYER_ROLES if not isinstance(layer, dict) or r not in layer]
            if lacking:
                raise PackageError(f"{mpath}: io.layers[{i}] lacks {lacking}")
        cold = manifest.get("cold_tier")
        if cold is not None:
            if not isinstance(cold, dict) or any(k not in cold for k in COLD_TIER_FIELDS):
                raise PackageError(f"{mpath}: cold_tier must hold {list(COLD_TIER_FIELDS)}")
            for i, layer in enumerate(io["layers"]):
                lacking = [r for r in COLD_ROLES if r not in layer]
                if lacking:
                    raise PackageError(f"{mpath}: io.layers[{i}] lacks the cold-tier inputs {lacking}")
        _check_two_level(mpath, manifest, io["layers"])
        if "logits" not in io.get("outputs", {}):
            raise PackageError(f"{mpath}: io.outputs lacks 'logits'")
        if manifest.get("dtype", "float32") not in ("float32", "float16"):
            raise PackageError(f"{mpath}: dtype must be float32 or float16, got {manifest.get('dtype')!r}")
        return cls(path, manifest)

    # ---- manifest fields ----------------------------------------------------
    @property
    def model_path(self) -> Path:
        return self.path / MODEL_FILE

    def ort_model_path(self, onnxruntime_version: str) -> Path:
        """The ORT-optimized copy the exporter saved (fast to load) when it was made by
        this ONNX Runtime version; otherwise the portable model."""
        opt = self.manifest.get("ort_optimized") or {}
        path = self.path / opt.get("file", "")
        if opt.get("onnxruntime") == onnxruntime_version and opt.get("file") and path.is_file():
            return path
        return self.model_path

    num_layers = property(lambda self: self.manifest["num_layers"])
    num_heads = property(lambda self: self.manifest["num_heads"])
    num_kv_heads = property(lambda self: self.manifest["num_kv_heads"])
    head_dim = property(lambda self: self.manifest["head_dim"])
    vocab_size = property(lambda self: self.manifest["vocab_size"])
    page_size = property(lambda self: self.manifest["page_size"])
    token_budget = property(lambda self: self.manifest["token_budget"], doc="default decode budget (0 = dense)")
    dtype = property(lambda self: self.manifest.get("dtype", "float32"))
    max_context = property(lambda self: self.manifest.get("max_context", 8192))

    @property
    def sub_page_size(self) -> int:
        """Two-level selection's sub-page tokens (``key_sub_bounds`` inputs of the sparse layers); 0: single level."""
        return self.manifest.get("sub_page_size", 0)

    @property
    def cold_tier(self) -> dict | None:
        return self.manifest.get("cold_tier")

    @property
    def inputs(self) -> dict:
        return self.manifest["io"]["inputs"]

    @property
    def layers(self) -> list[dict]:
        return self.manifest["io"]["layers"]

    @property
    def logits(self) -> str:
        return self.manifest["io"]["outputs"]["logits"]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the source's config (a model may list several); () when unknown."""
        eos = self.manifest.get("eos_token_id")
        if eos is None:
            return ()
        return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.manifest.get("bos_token_id")
        return bos[0] if isinstance(bos, list) and bos else bos

    # ---- tokenizer and chat template ------------------------------------------
    @cached_property
    def tokenizer(self):
        """The HF ``tokenizers.Tokenizer`` of ``tokenizer.json``; PackageError if absent."""
        file = self.path / "tokenizer.json"
        if not file.is_file():
            raise PackageError(f"{self.path}: no tokenizer.json; pass prompt token ids instead of text")
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(file))

    @cached_property
    def tokenizer_config(self) -> dict:
        file = self.path / "tokenizer_config.json"
        try:
            return json.loads(file.read_text()) if file.is_file() else {}
        except json.JSONDecodeError:
            return {}

    @cached_property
    def chat_template(self) -> str | None:
        """``chat_template.jinja`` or tokenizer_config.json's ``chat_template``, if any."""
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        template = self.tokenizer_config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return template if isinstance(template, str) else None

    def _special(self, name: str) -> str:
        token = self.tokenizer_config.get(name)
        return token.get("content", "") if isinstance(token, dict) else (token or "")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ([{"role", "content"}]) with the package's chat template (jinja2)."""
        if self.chat_template is None:
            raise PackageError(f"{self.path}: the package has no chat template")
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise PackageError("chat templates need jinja2: pip install jinja2") from None

        def raise_exception(msg):
            raise jinja2.TemplateError(msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._special("bos_token"), eos_token=self._special("eos_token"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (special tokens as the tokenizer's post-processor adds them,
        like HF's default; pass False for text rendered by a chat template)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def _check_two_level(mpath: Path, manifest: dict, layers: list) -> None:
    """``sub_page_size`` (absent: 0) divides the page size, and exactly the layers that select
    (policy not dense) take ``key_sub_bounds`` when it is set; none does when it is 0."""
    sp, ps = manifest.get("sub_page_size", 0), manifest["page_size"]
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 0 or (sp and (ps % sp or sp == ps)):
        raise PackageError(f"{mpath}: sub_page_size must be 0 or a proper divisor of page_size {ps}, got {sp!r}")
    for i, layer in enumerate(layers):
        if (SUB_ROLE in layer) != bool(sp and layer.get("policy") != "dense"):
            raise PackageError(f"{mpath}: io.layers[{i}] ({layer.get('policy')}) "
                               + (f"lacks {SUB_ROLE!r} for sub_page_size {sp}" if sp else
                                  f"has {SUB_ROLE!r} but sub_page_size is 0"))
