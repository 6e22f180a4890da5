"""The plugin installs with the package (issue #32): the wheel carries its sources and the build
command, ``tinyserve-build-plugin`` runs from the installed layout, and the runtime finds the
libraries where the command puts them (``EngineConfig.plugin_dir``, then the environment
overrides, then its default cache)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tinyserve_trt.cpu import native
from tinyserve_trt.cuda import library, plugin, plugin_build

ROOT = Path(__file__).resolve().parents[2]
BUILD_FILES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel --no-deps --no-build-isolation`` of a copy of this checkout (the build writes
    build/ and egg-info where it runs: not into the worktree)."""
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_FILES:
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.o", "plugin_sources", "prebuilt")
    for tree in ("tinyserve_trt", "plugins"):
        shutil.copytree(ROOT / tree, src / tree, ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          str(src), "-w", str(out)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    (whl,) = out.glob("*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed into a fresh directory (``pip install --target``)."""
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    return site


def _names(whl: Path) -> list[str]:
    with zipfile.ZipFile(whl) as z:
        return z.namelist()


def _inside(names: list[str], suffix: str) -> bool:
    return any(n.endswith(suffix) for n in names)


def test_the_wheel_carries_the_plugin_sources_and_the_build_command(wheel):
    names = _names(wheel)
    shipped = "tinyserve_trt/cuda/plugin_sources/"
    for path in plugin_build.source_files(ROOT / "plugins"):  # every kernel, glue, header, CMake and build file
        assert _inside(names, shipped + path.relative_to(ROOT / "plugins").as_posix()), path
    for needed in ("kernels/qsa_decode.cu", "tensorrt/QueryAwareSparseAttentionPlugin.cpp", "generated/qsa_schema.h",
                   "emulation/cuda_emu.h", "CMakeLists.txt", "build.py"):
        assert _inside(names, shipped + needed), needed
    assert _inside(names, "tinyserve_trt/cuda/plugin_build.py")
    with zipfile.ZipFile(wheel) as z:
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "tinyserve-build-plugin = tinyserve_trt.cuda.plugin_build:main" in entry_points
    assert not any("/build/" in n or n.endswith(".o") for n in names)


def test_the_wheel_carries_the_prebuilt_cpu_op_with_its_abi_in_the_name(wheel):
    try:
        native._compiler_version(native.compiler())
    except native.NativeUnavailable as e:
        pytest.skip(f"no host compiler at wheel build time: {e}")
    names = _names(wheel)
    assert _inside(names, f"tinyserve_trt/cpu/prebuilt/{native.prebuilt_name()}")
    assert f"abi{native.ABI_VERSION}" in native.prebuilt_name()
    assert wheel.name.endswith(".whl") and "-none-any" not in wheel.name  # a binary wheel: not pure Python
    assert "-py3-none-" in wheel.name  # loaded by ctypes / ONNX Runtime: any Python 3


def test_build_plugin_dry_run_prints_the_commands_from_the_installed_layout(installed, tmp_path):
    if not (os.environ.get("CUDACXX") or shutil.which("nvcc")):
        pytest.skip("no nvcc: the dry run prints the nvcc it found")
    include = tmp_path / "trt-include"
    include.mkdir()
    (include / "NvInfer.h").write_text("// stand-in: a dry run only checks that the header is there\n")
    env = dict(os.environ, PYTHONPATH=str(installed), TINYSERVE_CACHE=str(tmp_path / "cache"))
    args = ["--arch", "sm_87", "--dry-run"] + (["--tensorrt-include", str(include)] if shutil.which("cmake") else [])
    res = subprocess.run([sys.executable, str(installed / "bin" / "tinyserve-build-plugin"), *args], cwd=tmp_path,
                         env=env, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    sources = installed / "tinyserve_trt" / "cuda" / "plugin_sources"
    lines = res.stdout.splitlines()
    nvcc = lines[0].split()
    assert "-gencode=arch=compute_87,code=sm_87" in nvcc and "-shared" in nvcc
    assert {Path(a).name for a in nvcc if a.endswith(".cu")} == {p.name for p in (ROOT / "plugins/kernels").glob("*.cu")}
    assert all(a.startswith(str(sources)) for a in nvcc if a.endswith(".cu"))  # the installed copy
    assert nvcc[nvcc.index("-o") + 1].startswith(str(tmp_path / "cache" / "plugins"))  # this user's cache
    assert not (tmp_path / "cache").exists()  # a dry run writes nothing
    if shutil.which("cmake"):
        configure, make = lines[1].split(), lines[2].split()
        assert configure[configure.index("-S") + 1] == str(sources)
        assert f"-DTENSORRT_INCLUDE_DIR={include}" in configure and "-DCMAKE_CUDA_ARCHITECTURES=87-real" in configure
        assert "--target" in make and "tinyserve_trt_plugin" in make


@pytest.mark.parametrize("args, match", [
    (["--arch", "ampere"], "compute capability"),
    (["--arch", "87", "--tensorrt-include", "/nonexistent-dir"], "no NvInfer.h"),
])
def test_bad_input_is_one_line_exit_2(capsys, args, match):
    assert plugin_build.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err


def test_the_runtime_finds_the_libraries_where_the_command_puts_them(monkeypatch, tmp_path):
    monkeypatch.setenv(native.ENV_CACHE, str(tmp_path / "cache"))
    for env in (library.LIB_ENV, plugin.PLUGIN_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(plugin_build, "CHECKOUT_BUILD", tmp_path / "no-checkout-build")
    with pytest.raises(plugin.TensorRTUnavailable, match="tinyserve-build-plugin --arch sm_XX --tensorrt-include") \
            as err:
        plugin.plugin_library()
    assert "\n" not in str(err.value)
    cache = plugin_build.default_output()
    assert cache.parent == tmp_path / "cache" / "plugins"  # keyed by the sources: an upgrade builds anew
    cache.mkdir(parents=True)
    for name in (plugin_build.KERNELS_LIBRARY, plugin_build.PLUGIN_LIBRARY):
        (cache / name).write_bytes(b"")
    assert library.library_path() == cache / plugin_build.KERNELS_LIBRARY
    assert plugin.plugin_library() == cache / plugin_build.PLUGIN_LIBRARY
    # the config field (tinyserve-build-plugin -o DIR) first, then the environment override
    chosen = tmp_path / "chosen"
    chosen.mkdir()
    (chosen / plugin_build.PLUGIN_LIBRARY).write_bytes(b"")
    override = tmp_path / "override.so"
    override.write_bytes(b"")
    monkeypatch.setenv(plugin.PLUGIN_ENV, str(override))
    assert plugin.plugin_library(chosen) == chosen / plugin_build.PLUGIN_LIBRARY
    assert plugin.plugin_library() == override
    with pytest.raises(plugin.TensorRTUnavailable, match=str(tmp_path / "empty")):
        plugin.plugin_library(tmp_path / "empty")  # a plugin_dir without the library: said, not skipped


@pytest.mark.slow
def test_build_plugin_compiles_the_kernels_for_sm_87(installed, tmp_path):
    """The real build from the installed sources (nvcc, one arch: ~1 minute on 2 cores)."""
    if not (os.environ.get("CUDACXX") or shutil.which("nvcc")):
        pytest.skip("no nvcc")
    env = dict(os.environ, PYTHONPATH=str(installed))
    res = subprocess.run([sys.executable, str(installed / "bin" / "tinyserve-build-plugin"), "--arch", "sm_87",
                          "-o", str(tmp_path / "out")], cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    lib = tmp_path / "out" / plugin_build.KERNELS_LIBRARY
    assert lib.is_file() and [p.name for p in (tmp_path / "out").iterdir()] == [lib.name]  # no temp dir left
    assert library.library_path(tmp_path / "out") == lib
    loaded = library.load(lib)  # loads without a GPU; calling it would need one
    assert hasattr(loaded, "qsa_forward") and not library.is_emulated(loaded)
