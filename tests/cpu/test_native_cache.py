"""The native build cache is untrusted until checked (issue #29): per user, never a directory
another user can write; a cached library that does not load is rebuilt once, and when that fails
too the runtime loads the portable graph with a warning - never ORT's ``Fail`` traceback."""

from __future__ import annotations

import logging
import os

import pytest

from tinyserve_trt.cpu import native

pytestmark = pytest.mark.skipif(native.available() is not None, reason="no native build here")


@pytest.fixture(scope="module")
def good_library() -> bytes:
    """The bytes of this process's (default cache) build, read before a test moves the cache."""
    return native.library_path().read_bytes()


@pytest.fixture
def fresh(monkeypatch, tmp_path, good_library):
    """This process's build forgotten, the cache in ``tmp_path / 'cache'``."""
    monkeypatch.setattr(native, "_BUILT", {})
    monkeypatch.setenv(native.ENV_CACHE, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fake_compiler(monkeypatch, content: bytes) -> list:
    """Replace the compile step with one that writes ``content``; returns its calls."""
    calls = []

    def compile_to(cmd_out: str, *args, **kwargs):
        calls.append(cmd_out)
        with open(cmd_out, "wb") as f:
            f.write(content)

    monkeypatch.setattr(native, "_compile", lambda cxx, march, source_dir, out: compile_to(out))
    return calls


def _seed(root, content: bytes):
    lib = native.library_file(root=root)
    native.private_dir(root, "native", lib.parent.name)
    lib.write_bytes(content)
    return lib


def test_a_corrupt_cached_library_is_rebuilt_once(fresh, monkeypatch, good_library, caplog):
    lib = _seed(fresh, b"\x7fELF garbage")
    calls = _fake_compiler(monkeypatch, good_library)
    with caplog.at_level(logging.WARNING, logger="tinyserve.cpu"):
        assert native.available() is None
    assert len(calls) == 1 and native.library_path() == lib and lib.read_bytes() == good_library
    assert "rebuilding" in caplog.text
    assert [p.name for p in lib.parent.iterdir()] == [native.LIBRARY_NAME]  # no temp file left


def test_a_rebuild_that_does_not_load_either_is_one_line(fresh, monkeypatch):
    _seed(fresh, b"garbage")
    calls = _fake_compiler(monkeypatch, b"still garbage")
    reason = native.available()
    assert reason is not None and "cannot be loaded" in reason and "\n" not in reason
    assert len(calls) == 1


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_cache_other_users_can_write_is_not_used(fresh, monkeypatch, mode):
    fresh.mkdir()
    fresh.chmod(mode)
    calls = _fake_compiler(monkeypatch, b"")
    reason = native.available()
    assert reason is not None and "writable by other users" in reason and "\n" not in reason
    assert not calls and not list(fresh.iterdir())


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_cache_owned_by_another_user_is_not_used(fresh, monkeypatch):
    fresh.mkdir(mode=0o755)
    os.chown(fresh, 1, 1)
    calls = _fake_compiler(monkeypatch, b"")
    reason = native.available()
    assert reason is not None and "owned by another user" in reason and not calls


def test_new_cache_directories_are_private(fresh, monkeypatch, good_library):
    _fake_compiler(monkeypatch, good_library)
    lib = native.library_path()
    for d in (fresh, fresh / "native", lib.parent):
        assert os.stat(d).st_mode & 0o777 == 0o700


def test_the_runtime_loads_the_portable_graph_when_the_library_is_broken(llama, fresh, monkeypatch, caplog):
    """A package whose optimized graph calls the native op: with a cache whose library does not
    load (and a rebuild that does not either), the session is the portable model, logged."""
    import onnxruntime as ort

    from tinyserve_trt.runtime.llm import LLM
    from tinyserve_trt.runtime.sampling import SamplingParams

    _, pkg, manifest = llama
    opt = manifest.get("ort_optimized") or {}
    if opt.get("onnxruntime") != ort.__version__ or not (opt.get("plan") or {}).get("native_domain"):
        pytest.skip("the tiny package's optimized graph does not call the native op here")
    _seed(fresh, b"garbage")
    _fake_compiler(monkeypatch, b"still garbage")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="tinyserve.runtime"):
        llm = LLM(pkg, max_batch=2)
        out = llm.generate(params=params, prompt_token_ids=[[1, 2, 3]])
    assert "native CPU decode kernel is unavailable" in caplog.text and "loading the portable model" in caplog.text
    assert len(out[0].outputs[0].token_ids) == 3
