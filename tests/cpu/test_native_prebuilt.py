"""The wheel's prebuilt native CPU op (issue #32): used where this machine cannot compile, never
when it can (the -march=native JIT build is faster); its C ABI version is in its file name; one
that another user can write is not loaded; without it and without a compiler, one line says both."""

from __future__ import annotations

import pytest

from tinyserve_trt.cpu import native

pytestmark = pytest.mark.skipif(native.available() is not None or native.PREBUILT_MARCH.get(
    __import__("platform").machine()) is None, reason="no native build (or no baseline target) here")


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """A prebuilt directory as setup.py writes it."""
    out = tmp_path_factory.mktemp("prebuilt")
    native.build_prebuilt(out)
    return out


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_BUILT", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(native.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.delenv(native.ENV_DISABLE, raising=False)


def test_the_prebuilt_library_is_named_by_its_abi_and_machine(prebuilt):
    import platform

    (lib,) = prebuilt.iterdir()
    assert lib.name == f"libtinyserve_cpu.abi{native.ABI_VERSION}.{platform.machine()}.so"
    assert native.prebuilt_library(prebuilt) == (lib, "")


def test_without_a_compiler_the_prebuilt_library_is_used(prebuilt, no_compiler, monkeypatch):
    monkeypatch.setattr(native, "PREBUILT_DIR", prebuilt)
    assert native.available() is None
    assert native.library_path() == prebuilt / native.prebuilt_name()


def test_with_a_compiler_the_jit_build_wins(prebuilt, monkeypatch):
    monkeypatch.setattr(native, "PREBUILT_DIR", prebuilt)
    monkeypatch.setattr(native, "_BUILT", {})
    assert native.library_path().parent != prebuilt


def test_without_either_one_line_names_both(no_compiler, monkeypatch, tmp_path):
    monkeypatch.setattr(native, "PREBUILT_DIR", tmp_path / "none")
    reason = native.available()
    assert "no C++ compiler" in reason and "no prebuilt library in this install" in reason and "\n" not in reason


def test_a_prebuilt_library_others_can_write_is_not_loaded(prebuilt, no_compiler, monkeypatch, tmp_path):
    import shutil

    unsafe = tmp_path / "unsafe"
    unsafe.mkdir()
    shutil.copy(prebuilt / native.prebuilt_name(), unsafe / native.prebuilt_name())
    (unsafe / native.prebuilt_name()).chmod(0o666)
    monkeypatch.setattr(native, "PREBUILT_DIR", unsafe)
    reason = native.available()
    assert reason is not None and "writable by no one else" in reason


def test_another_abi_version_is_not_picked_up(prebuilt, no_compiler, monkeypatch):
    monkeypatch.setattr(native, "PREBUILT_DIR", prebuilt)
    monkeypatch.setattr(native, "ABI_VERSION", native.ABI_VERSION + 1)
    assert "no prebuilt library" in native.available()


def test_the_engine_reports_the_prebuilt_kernel(llama, prebuilt, no_compiler, monkeypatch):
    import onnxruntime as ort

    from tinyserve_trt.runtime.llm import LLM

    _, pkg, manifest = llama
    opt = manifest.get("ort_optimized") or {}
    if opt.get("onnxruntime") != ort.__version__ or not (opt.get("plan") or {}).get("native_domain"):
        pytest.skip("the tiny package's optimized graph does not call the native op here")
    monkeypatch.setattr(native, "PREBUILT_DIR", prebuilt)
    llm = LLM(pkg, max_batch=2, require_native=True)  # no fallback: the prebuilt kernel is native
    report = llm.engine.kernel_report
    assert report.decode_kernel == "native_cpu" and report.library == str(prebuilt / native.prebuilt_name())


def test_abi_version_follows_the_node_version():
    """The prebuilt library's file name carries the node's version: a wheel built before the
    node's inputs moved (version 1: key_sub_bounds at 10) is never picked up by a version-2 runtime."""
    from tinyserve_trt.cpu import native, node

    assert native.ABI_VERSION == node.VERSION
    assert f"abi{node.VERSION}." in native.prebuilt_name()
