"""ModelPackage: a directory written by ``tinyserve-export``, loaded and checked.

A package holds ``model.onnx`` (+ ``model.onnx.data``), the ``tinyserve.json``
manifest (dims, paged I/O names, defaults) and the source's tokenizer files.
``ModelPackage.load`` reads the typed manifest (``contracts.manifest.Manifest``,
which checks what the runtime relies on and raises ``PackageError`` with one
line naming the problem); it does not open the model. This class is the
runtime's view of it: dims and I/O names as attributes, the tokenizer and the
chat template.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

from tinyserve_trt.contracts.manifest import MODEL_FILE, Manifest, PackageError
from tinyserve_trt.contracts.package_paths import resolve_inside

__all__ = ["ModelPackage", "PackageError"]


@dataclass(frozen=True)
class ModelPackage:
    """A validated package. Dims come from the manifest; I/O names from ``io``.

    spec:    the typed manifest (``contracts.manifest.Manifest``).
    manifest: the same as the JSON dict (``tinyserve.json``), for tools and extra keys.
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
    spec: Manifest

    @classmethod
    def load(cls, path: str | Path) -> ModelPackage:
        """Check the manifest, ``tokenizer_config.json`` and the chat template (PackageError, one
        line: a malformed file fails here, not on every chat request); ``tokenizer.json`` is
        parsed on first use."""
        path = Path(path)
        package = cls(path, Manifest.load(path))
        package.tokenizer_config, package.chat_template  # noqa: B018 - read and checked now
        return package

    # ---- manifest fields ----------------------------------------------------
    @cached_property
    def manifest(self) -> dict:
        return self.spec.to_dict()

    @property
    def model_path(self) -> Path:
        return self.path / MODEL_FILE

    def ort_model_path(self, onnxruntime_version: str) -> Path:
        """ORT's optimized graph the exporter saved (fast to load; it reads the weights of
        ``model.onnx.data``) when it was made by this ONNX Runtime version; otherwise the
        portable model."""
        opt = self.spec.ort_optimized
        if opt is not None and opt.onnxruntime == onnxruntime_version:
            path = resolve_inside(self.path, opt.file, "ort_optimized.file")
            if path.is_file():
                return path
        return self.model_path

    def file(self, name: str) -> Path:
        """``name`` in the package (``package_paths.resolve_inside``: PackageError for an absolute
        name, ``..`` or a link that leads outside the package)."""
        try:
            return resolve_inside(self.path, name, name)
        except PackageError as e:
            raise PackageError(f"{self.path}: {e}") from None

    num_layers = property(lambda self: self.spec.num_layers)
    num_heads = property(lambda self: self.spec.num_heads)
    num_kv_heads = property(lambda self: self.spec.num_kv_heads)
    head_dim = property(lambda self: self.spec.head_dim)
    vocab_size = property(lambda self: self.spec.vocab_size)
    page_size = property(lambda self: self.spec.page_size)
    token_budget = property(lambda self: self.spec.token_budget, doc="default decode budget (0 = dense)")
    budget_share = property(lambda self: self.spec.budget_share,
                            doc="the default budget's share of the context above token_budget (0: fixed)")
    decode_budget = property(lambda self: self.spec.decode_budget, doc="the default decode budget (DecodeBudget)")
    dtype = property(lambda self: self.spec.dtype)
    max_context = property(lambda self: self.spec.max_context)
    sub_page_size = property(lambda self: self.spec.sub_page_size,
                             doc="two-level selection's sub-page tokens (key_sub_bounds per sparse layer); 0: single")

    @cached_property
    def cold_tier(self) -> dict | None:
        return None if self.spec.cold_tier is None else asdict(self.spec.cold_tier)

    @property
    def inputs(self) -> dict:
        return self.spec.io.inputs

    @property
    def layers(self) -> list[dict]:
        return self.spec.io.layers

    @property
    def logits(self) -> str:
        return self.spec.io.outputs["logits"]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the source's config (a model may list several); () when unknown."""
        eos = self.spec.eos_token_id
        if eos is None:
            return ()
        return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.spec.bos_token_id
        if isinstance(bos, list):
            return bos[0] if bos else None
        return bos

    # ---- tokenizer and chat template ------------------------------------------
    @cached_property
    def tokenizer(self):
        """The HF ``tokenizers.Tokenizer`` of ``tokenizer.json``; PackageError if absent."""
        file = self.file("tokenizer.json")
        if not file.is_file():
            raise PackageError(f"{self.path}: no tokenizer.json; pass prompt token ids instead of text")
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises plain Exception for a malformed file
            first = " ".join((str(e).strip().splitlines() or [type(e).__name__])[0].split())[:200]
            raise PackageError(f"{file}: cannot load the tokenizer ({first})") from None

    @cached_property
    def tokenizer_config(self) -> dict:
        """``tokenizer_config.json`` ({} when absent), checked: an object whose ``chat_template``
        is a string or a list of ``{name, template}`` objects and whose ``bos_token`` /
        ``eos_token`` are strings or ``{content: string}``; PackageError otherwise."""
        file = self.file("tokenizer_config.json")
        if not file.is_file():
            return {}
        try:
            data = json.loads(file.read_bytes().decode("utf-8"))
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise PackageError(f"{file}: not valid JSON ({' '.join(str(e).split())[:200]})") from None
        if not isinstance(data, dict):
            raise PackageError(f"{file}: must hold a JSON object, got a {type(data).__name__}")
        template = data.get("chat_template")
        named = isinstance(template, list) and all(
            isinstance(t, dict) and isinstance(t.get("template"), str) for t in template)
        if template is not None and not isinstance(template, str) and not named:
            raise PackageError(f"{file}: chat_template must be a string or a list of "
                               "{\"name\", \"template\": string} objects")
        for name in ("bos_token", "eos_token"):
            token = data.get(name)
            content = token.get("content", "") if isinstance(token, dict) else token
            if content is not None and not isinstance(content, str):
                raise PackageError(f"{file}: {name} must be a string or {{\"content\": string}}, got {token!r}")
        return data

    @cached_property
    def chat_template(self) -> str | None:
        """``chat_template.jinja`` or tokenizer_config.json's ``chat_template``, if any."""
        jinja = self.file("chat_template.jinja")
        if jinja.is_file():
            try:
                return jinja.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                raise PackageError(f"{jinja}: not UTF-8 text") from None
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
