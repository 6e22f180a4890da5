"""Building libtinyserve_cpu.so: the cache key, the one-line reasons it is unavailable."""

from __future__ import annotations

import shutil

import pytest

from tinyserve_trt.cpu import native


def _key(sources, flags="avx2 fma"):
    return native.build_key("c++", "g++ 12.2", sources, "x86_64", flags)


def test_cache_key_changes_with_sources_and_cpu():
    base = {"a.cpp": b"int f();", "a.h": b"#pragma once"}
    assert _key(base) == _key(dict(base))
    assert _key(base) != _key({**base, "a.cpp": b"int f(); "})
    assert _key(base) != _key({**base, "a.h": b"#pragma once\n"})
    assert _key(base) != _key(base, flags="avx2 fma avx512f")
    assert _key(base) != native.build_key("c++", "g++ 13.1", base, "x86_64", "avx2 fma")


def test_disabled_by_env(monkeypatch):
    monkeypatch.setenv(native.ENV_DISABLE, "0")
    reason = native.available()
    assert reason is not None and "TINYSERVE_NATIVE=0" in reason and "\n" not in reason
    with pytest.raises(native.NativeUnavailable):
        native.library_path()


def test_missing_compiler_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(native.NativeUnavailable, match="no C\\+\\+ compiler") as info:
        native.build(native.SOURCE_DIR, tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(shutil.which(native.compiler()) is None, reason="no C++ compiler")
def test_compile_error_gives_its_first_error_line(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / native.SOURCES[0]).write_text("int broken( {\n")
    with pytest.raises(native.NativeUnavailable, match="compiling libtinyserve_cpu.so failed: .*error") as info:
        native.build(src, tmp_path / "cache")
    assert "\n" not in str(info.value)
    assert not list((tmp_path / "cache").rglob("*.so"))  # no partial build left behind


@pytest.mark.skipif(shutil.which(native.compiler()) is None, reason="no C++ compiler")
def test_build_lands_under_the_cache_key(monkeypatch, tmp_path):
    monkeypatch.setenv(native.ENV_CACHE, str(tmp_path))
    lib = native.build()
    assert lib.is_file() and lib.parent.parent == tmp_path / "native"
    assert native.build() == lib  # cached: same key, no rebuild
    assert [p.name for p in lib.parent.iterdir()] == [native.LIBRARY_NAME]


@pytest.mark.skipif(shutil.which(native.compiler()) is None, reason="no C++ compiler")
def test_unwritable_cache_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache directory should go
    with pytest.raises(native.NativeUnavailable, match="cannot write the build cache") as info:
        native.build(native.SOURCE_DIR, blocker)
    assert "\n" not in str(info.value)
