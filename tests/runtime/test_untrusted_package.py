"""A package is untrusted input (issue #29): what the runtime writes beside it, the caches it
hands to ONNX Runtime, and the one-line PackageErrors for bad package content."""

from __future__ import annotations

import os

import pytest

onnx = pytest.importorskip("onnx")

from tinyserve_trt.runtime.backends import ort_providers  # noqa: E402

from tests.runtime.backend_options import backend_options  # noqa: E402

from .test_ort_gpu import _model_with_function  # noqa: E402


@pytest.fixture
def outside(tmp_path):
    """A file outside the package (a stand-in for ~/.bashrc) and the package directory."""
    victim = tmp_path / "bashrc"
    victim.write_bytes(b"export PS1='$ '\n")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    _model_with_function(pkg / "model.onnx")
    return victim, pkg


# ---- finding 1: the inlined model is written to a fresh temp file, never through a shipped link ----
@pytest.mark.parametrize("name", ["model.inlined.tmp", "model.inlined.onnx"])
def test_inlining_never_writes_through_a_symlink_the_package_ships(outside, name):
    victim, pkg = outside
    before = victim.read_bytes()
    (pkg / name).symlink_to(victim)
    os.utime(victim)  # newer than model.onnx: a naive cache check would take it
    model = ort_providers.inlined_model(pkg / "model.onnx")
    assert victim.read_bytes() == before
    assert isinstance(model, (bytes, os.PathLike, str))
    if not isinstance(model, bytes):
        model = os.fspath(model)
        assert os.path.realpath(model).startswith(os.path.realpath(pkg) + os.sep)
        assert not os.path.islink(model)
        inlined = onnx.load(model)
        assert not inlined.functions and [n.op_type for n in inlined.graph.node] == ["Add"]
    assert not [p for p in pkg.iterdir() if p.name.startswith(".") or p.suffix == ".tmp" and not p.is_symlink()]


# ---- finding 2: TensorRT engines are code: a shipped engine cache is used only when asked ----
def _trt_package(tmp_path):
    import types

    pkg = tmp_path / "pkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "trt_ep_cache").mkdir(exist_ok=True)  # shipped engines
    return types.SimpleNamespace(path=pkg, dtype="float16", manifest={}, max_context=256)


def test_tensorrt_engine_cache_is_per_user_unless_the_package_is_trusted(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path / "cache"))
    package = _trt_package(tmp_path)
    opts = ort_providers.tensorrt_options(package, 0, tmp_path / "plugin.so")
    cache = opts["trt_engine_cache_path"]
    assert opts["trt_engine_cache_enable"] is True
    assert os.path.realpath(cache).startswith(os.path.realpath(tmp_path / "cache" / "trt_ep_cache") + os.sep)
    assert os.path.isdir(cache) and os.stat(cache).st_mode & 0o777 == 0o700
    (tmp_path / "other").mkdir()
    other = _trt_package(tmp_path / "other")
    assert ort_providers.tensorrt_options(other, 0, tmp_path / "p.so")["trt_engine_cache_path"] != cache
    trusted = ort_providers.tensorrt_options(package, 0, tmp_path / "plugin.so", trust_package_engines=True)
    assert trusted["trt_engine_cache_path"] == str(package.path / "trt_ep_cache")


def test_engine_config_takes_the_opt_in():
    from tinyserve_trt.runtime.config import EngineConfig

    assert EngineConfig().trust_package_engines is False
    assert EngineConfig(trust_package_engines=True).trust_package_engines is True
    with pytest.raises(ValueError, match="trust_package_engines must be a bool"):
        EngineConfig(trust_package_engines="yes")


def test_a_cache_dir_other_users_can_write_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o777)
    monkeypatch.setenv("TINYSERVE_CACHE", str(root))
    with pytest.raises(RuntimeError) as err:
        ort_providers.tensorrt_options(_trt_package(tmp_path), 0, tmp_path / "plugin.so")
    assert "writable by other users" in str(err.value) and "\n" not in str(err.value)


def test_a_trusted_engine_cache_must_still_be_inside_the_package(tmp_path):
    from tinyserve_trt.contracts.manifest import PackageError

    package = _trt_package(tmp_path)
    (package.path / "trt_ep_cache").rmdir()
    (tmp_path / "elsewhere").mkdir()
    (package.path / "trt_ep_cache").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PackageError, match="outside the package"):
        ort_providers.tensorrt_options(package, 0, tmp_path / "plugin.so", trust_package_engines=True)


# ---- finding 5: a corrupt model.onnx is one PackageError line naming the file ----
def _manifest_package(path):
    """A package with a real manifest (tests/contracts/test_manifest.py's) and whatever model.onnx."""
    import json

    from tests.contracts.test_manifest import manifest

    (path / "tinyserve.json").write_text(json.dumps(manifest(dtype="float32").to_dict()))
    return path


def _backend(pkg_dir, provider="cpu"):
    from tinyserve_trt.runtime.backends.ort import OrtBackend
    from tinyserve_trt.runtime.config import CacheConfig
    from tinyserve_trt.runtime.model_package import ModelPackage
    from tinyserve_trt.runtime.pages import PagePool

    package = ModelPackage.load(pkg_dir)
    pool = PagePool(CacheConfig(page_size=package.page_size, num_pages=8, dtype="float32"), package.num_layers,
                    package.num_kv_heads, package.head_dim)
    return OrtBackend(package, pool, provider=provider)


@pytest.mark.parametrize("content", ["garbage", "truncated"])
def test_a_corrupt_model_is_one_package_error_naming_the_file(tmp_path, content):
    from tinyserve_trt.contracts.manifest import PackageError

    pytest.importorskip("onnxruntime")
    pkg = _manifest_package(tmp_path)
    _model_with_function(pkg / "model.onnx")
    data = (pkg / "model.onnx").read_bytes()
    (pkg / "model.onnx").write_bytes(b"\xff\x00garbage" * 40 if content == "garbage" else data[: len(data) // 2])
    with pytest.raises(PackageError) as err:
        _backend(pkg)
    text = str(err.value)
    assert str(pkg / "model.onnx") in text and "\n" not in text and "re-export" in text


def test_a_corrupt_model_is_one_package_error_when_inlining_too(tmp_path):
    from tinyserve_trt.contracts.manifest import PackageError

    (tmp_path / "model.onnx").write_bytes(b"\xff\x00garbage" * 40)
    with pytest.raises(PackageError) as err:
        ort_providers.inlined_model(tmp_path / "model.onnx")
    assert str(tmp_path / "model.onnx") in str(err.value) and "\n" not in str(err.value)


def test_a_corrupt_optimized_graph_falls_back_to_the_portable_model(llama, tmp_path, caplog):
    import shutil

    import onnxruntime as ort

    from tinyserve_trt.runtime.llm import LLM
    from tinyserve_trt.runtime.sampling import SamplingParams

    _, src, manifest = llama
    if manifest.get("ort_optimized", {}).get("onnxruntime") != ort.__version__:
        pytest.skip("the tiny package has no optimized graph for this ONNX Runtime")
    pkg = tmp_path / "pkg"
    shutil.copytree(src, pkg)
    (pkg / manifest["ort_optimized"]["file"]).write_bytes(b"\xff\x00garbage")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with caplog.at_level("WARNING", logger="tinyserve.runtime"):
        out = LLM(pkg, max_batch=2).generate(params=params, prompt_token_ids=[[1, 2, 3]])
    assert "loading the portable model" in caplog.text
    want = LLM(src, max_batch=2).generate(params=params, prompt_token_ids=[[1, 2, 3]])
    assert out[0].outputs[0].token_ids == want[0].outputs[0].token_ids


# ---- finding 6: tokenizer_config.json that is not an object is refused at load, not per chat request ----
@pytest.mark.parametrize("config, message", [
    ("[1, 2]", "must hold a JSON object, got a list"),
    ('"text"', "must hold a JSON object, got a str"),
    ("{", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    ('{"chat_template": 3}', "chat_template must be a string or a list of"),
    ('{"chat_template": ["x"]}', "chat_template must be a string or a list of"),
    ('{"chat_template": [{"name": "default", "template": 5}]}', "chat_template must be a string or a list of"),
    ('{"chat_template": "{{ x }}", "eos_token": ["a"]}', "eos_token must be a string"),
    ('{"chat_template": "{{ x }}", "bos_token": {"content": 1}}', "bos_token must be a string"),
])
def test_a_malformed_tokenizer_config_is_one_line_at_load(tmp_path, config, message):
    from tinyserve_trt.contracts.manifest import PackageError
    from tinyserve_trt.runtime.model_package import ModelPackage

    pkg = _manifest_package(tmp_path)
    (pkg / "model.onnx").write_bytes(b"")
    data = config if isinstance(config, bytes) else config.encode()
    (pkg / "tokenizer_config.json").write_bytes(data)
    with pytest.raises(PackageError) as err:
        ModelPackage.load(pkg)
    text = str(err.value)
    assert message in text and "tokenizer_config.json" in text and "\n" not in text


def test_a_chat_template_that_is_not_text_is_one_line_at_load(tmp_path):
    from tinyserve_trt.contracts.manifest import PackageError
    from tinyserve_trt.runtime.model_package import ModelPackage

    pkg = _manifest_package(tmp_path)
    (pkg / "model.onnx").write_bytes(b"")
    (pkg / "chat_template.jinja").write_bytes(b"\xff\xfe\x00{{")
    with pytest.raises(PackageError, match="chat_template.jinja: not UTF-8 text") as err:
        ModelPackage.load(pkg)
    assert "\n" not in str(err.value)


def test_named_chat_templates_and_token_objects_still_work(tmp_path):
    import json

    from tinyserve_trt.runtime.model_package import ModelPackage

    pkg = _manifest_package(tmp_path)
    (pkg / "model.onnx").write_bytes(b"")
    (pkg / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tools", "template": "T"}, {"name": "default", "template": "{{ bos_token }}hi"}],
        "bos_token": {"content": "<s>"}, "eos_token": None}))
    assert ModelPackage.load(pkg).apply_chat_template([{"role": "user", "content": "x"}]) == "<s>hi"


def test_a_corrupt_tokenizer_json_is_one_line(tmp_path):
    pytest.importorskip("tokenizers")
    from tinyserve_trt.contracts.manifest import PackageError
    from tinyserve_trt.runtime.model_package import ModelPackage

    pkg = _manifest_package(tmp_path)
    (pkg / "model.onnx").write_bytes(b"")
    (pkg / "tokenizer.json").write_text("[1, 2]")
    loaded = ModelPackage.load(pkg)
    with pytest.raises(PackageError, match="tokenizer.json: cannot load the tokenizer") as err:
        loaded.encode("hi")
    assert "\n" not in str(err.value)


def test_engine_passes_the_opt_in_to_the_ort_backend(monkeypatch):
    """EngineConfig(trust_package_engines=True) reached no backend before (the field was unread)."""
    from tinyserve_trt.runtime.config import EngineConfig

    for trust in (False, True):
        seen = backend_options(monkeypatch, EngineConfig(trust_package_engines=trust))
        assert seen.get("trust_package_engines", False) is trust
