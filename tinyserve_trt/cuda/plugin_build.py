"""``tinyserve-build-plugin``: build the CUDA kernels and the TensorRT plugin from the installed sources.

    tinyserve-build-plugin [--arch sm_87]... [--tensorrt-include DIR] [-o DIR] [--dry-run]

The sources travel with the package: a wheel carries ``plugins/`` as
``tinyserve_trt/cuda/plugin_sources/`` (``setup.py`` copies it at build time; git keeps one
copy, in ``plugins/``), a source checkout uses ``plugins/`` itself (:func:`sources`). The command
builds, into ``-o DIR`` or by default this user's cache ``$TINYSERVE_CACHE/plugins/<key>/``
(``~/.cache/tinyserve``; ``<key>`` hashes the sources, so an upgrade builds anew; the directory
is private, as ``cpu.native.private_dir`` makes it):

  libqsa_kernels.so           the kernels with their ``extern "C"`` launchers (nvcc, ``plugins/build.py``'s
                              flags), which ``cuda/library.py`` loads for the ORT CUDA / TensorRT EP paths
  libtinyserve_trt_plugin.so  with ``--tensorrt-include DIR`` (TensorRT's ``NvInfer.h``): the IPluginV3 plugin
                              (CMake, ``plugins/CMakeLists.txt``), which ``cuda/plugin.py`` loads

and the runtime finds both there (:func:`find_library`): ``EngineConfig.plugin_dir`` (the ``-o``
directory) first, then ``$TINYSERVE_QSA_LIB`` / ``$TINYSERVE_TRT_PLUGIN`` (one file each), the
default cache, and a source checkout's ``build/plugins/``. ``--dry-run`` prints the commands and
runs nothing. Exit 2 with one line for a missing nvcc / cmake / header; the library that was there
stays until a build has succeeded (each is renamed into place).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

KERNELS_LIBRARY = "libqsa_kernels.so"
PLUGIN_LIBRARY = "libtinyserve_trt_plugin.so"
INSTALLED_SOURCES = Path(__file__).resolve().parent / "plugin_sources"  # in a wheel (setup.py)
CHECKOUT_SOURCES = Path(__file__).resolve().parents[2] / "plugins"  # a source checkout
CHECKOUT_BUILD = Path(__file__).resolve().parents[2] / "build" / "plugins"
SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".cpp", ".py", ".txt", ".cmake")  # what a wheel carries
EXIT_USAGE = 2


class PluginBuildError(RuntimeError):
    """A build that cannot run (no nvcc, cmake or TensorRT header) or failed; one line."""


def sources() -> Path:
    """The plugin's source tree (``CMakeLists.txt``, ``build.py``, ``kernels/``, ``tensorrt/``, ...)."""
    for root in (INSTALLED_SOURCES, CHECKOUT_SOURCES):
        if (root / "CMakeLists.txt").is_file() and (root / "build.py").is_file():
            return root
    raise PluginBuildError(f"the plugin sources are not installed (looked in {INSTALLED_SOURCES} and "
                           f"{CHECKOUT_SOURCES}); reinstall tinyserve-trt from a wheel or a source checkout")


def source_files(root: Path) -> list[Path]:
    """The files a build reads, in a stable order (what the wheel ships and the cache key hashes)."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES
                  and "__pycache__" not in p.parts)


def source_key(root: Path) -> str:
    h = hashlib.sha256()
    for p in source_files(root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def default_output(root: Path | None = None) -> Path:
    """Where the command builds by default: ``<cache root>/plugins/<source key>`` (not created here)."""
    from tinyserve_trt.cpu.native import cache_root

    return cache_root() / "plugins" / source_key(root or sources())


def find_library(name: str, plugin_dir: str | os.PathLike | None = None, env: str | None = None) -> Path:
    """``name`` (:data:`KERNELS_LIBRARY` or :data:`PLUGIN_LIBRARY`): in ``plugin_dir`` when given (it must
    be there), else ``$env`` when set, else the default cache, else a checkout's ``build/plugins``;
    FileNotFoundError (one line) naming where it looked and the command that builds it."""
    if plugin_dir is not None:
        candidates = [Path(plugin_dir) / name]
    elif env and os.environ.get(env):
        candidates = [Path(os.environ[env])]
    else:
        candidates = []
        try:
            candidates.append(default_output() / name)
        except PluginBuildError:
            pass
        candidates.append(CHECKOUT_BUILD / name)
    for path in candidates:
        if path.is_file():
            return path
    flag = " --tensorrt-include DIR" if name == PLUGIN_LIBRARY else ""
    where = " or ".join(str(p) for p in candidates)
    raise FileNotFoundError(f"{name} not found (looked at {where}): build it with "
                            f"`tinyserve-build-plugin --arch sm_XX{flag}` (the GPU's compute capability)"
                            + (f" or set ${env}" if env else ""))


# ---- the build -----------------------------------------------------------------------------
def _build_script(root: Path):
    """``plugins/build.py`` as a module: its nvcc lookup, arch list and flags are the kernels' one definition."""
    spec = importlib.util.spec_from_file_location("tinyserve_plugin_build_script", root / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def arch_number(text: str) -> str:
    """``sm_87`` / ``87`` / ``8.7`` -> ``87``; ValueError for anything else."""
    m = re.fullmatch(r"(?:sm_|compute_)?(\d)\.?(\d{1,2}[a-z]?)", text.strip())
    if not m:
        raise ValueError(f"--arch must name a compute capability like sm_87 or 90, got {text!r}")
    return m.group(1) + m.group(2)


def _nvcc(script) -> str:
    try:
        return script.find_nvcc()
    except SystemExit as e:  # build.py's one line
        raise PluginBuildError(str(e)) from None


def kernels_command(script, nvcc: str, archs: list[str], out: Path) -> list[str]:
    """The nvcc line that links ``out`` from every kernel source (``build.py``'s ``library_command``)."""
    return script.library_command(nvcc, archs, out)


def plugin_commands(root: Path, nvcc: str, archs: list[str], tensorrt_include: Path, work: Path) -> list[list[str]]:
    """CMake configure + build of the TensorRT plugin (``plugins/CMakeLists.txt``) in ``work``."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise PluginBuildError("the TensorRT plugin is built by CMake (>= 3.24), which is not on PATH")
    cuda_archs = ";".join(f"{a}-real" for a in archs)
    return [[cmake, "-S", str(root), "-B", str(work), "-DCMAKE_BUILD_TYPE=Release",
             "-DTINYSERVE_BUILD_TRT_PLUGIN=ON", f"-DTENSORRT_INCLUDE_DIR={tensorrt_include}",
             f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_archs}"],
            [cmake, "--build", str(work), "--target", "tinyserve_trt_plugin", "-j", str(os.cpu_count() or 2)]]


def _run(cmd: list[str]) -> None:
    print("+ " + shlex.join(cmd), flush=True)
    res = subprocess.run(cmd, check=False)
    if res.returncode:
        raise PluginBuildError(f"{Path(cmd[0]).name} failed with status {res.returncode} (its output is above)")


def build(archs: list[str], out: Path | None = None, tensorrt_include: Path | None = None,
          dry_run: bool = False) -> list[Path]:
    """Build the kernels (and with ``tensorrt_include`` the plugin) for ``archs`` into ``out`` (default:
    :func:`default_output`); returns the libraries' paths. ``dry_run``: print the commands only."""
    root = sources()
    script = _build_script(root)
    archs = archs or list(script.ARCHS)
    if tensorrt_include is not None and not (Path(tensorrt_include) / "NvInfer.h").is_file():
        raise PluginBuildError(f"--tensorrt-include {tensorrt_include}: no NvInfer.h there (TensorRT's include/)")
    nvcc = _nvcc(script)
    if out is None:
        out = default_output(root)
        if not dry_run:
            from tinyserve_trt.cpu.native import CacheDirError, cache_root, private_dir

            try:
                private_dir(cache_root(), "plugins", out.name)
            except CacheDirError as e:
                raise PluginBuildError(str(e)) from None
    elif not dry_run:
        out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=out)) if not dry_run else out / ".build"
    try:
        steps = [(kernels_command(script, nvcc, archs, work / KERNELS_LIBRARY), work / KERNELS_LIBRARY)]
        if tensorrt_include is not None:
            configure, make = plugin_commands(root, nvcc, archs, Path(tensorrt_include), work / "cmake")
            steps += [(configure, None), (make, work / "cmake" / PLUGIN_LIBRARY)]
        if dry_run:
            for cmd, _ in steps:
                print(shlex.join(cmd))
            return [out / KERNELS_LIBRARY] + ([out / PLUGIN_LIBRARY] if tensorrt_include is not None else [])
        built = []
        for cmd, product in steps:
            _run(cmd)
            if product is not None:
                os.replace(product, out / product.name)  # the old library stays until this one exists
                built.append(out / product.name)
    finally:
        if not dry_run:
            shutil.rmtree(work, ignore_errors=True)
    return built


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tinyserve-build-plugin", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", default=[],
                    help="GPU compute capability, e.g. sm_87 (Jetson Orin) or sm_90 (H100/H200); repeatable; "
                         "default: every arch of plugins/build.py (slow)")
    ap.add_argument("--tensorrt-include", type=Path, metavar="DIR",
                    help="TensorRT's include/ (NvInfer.h): also build the TensorRT plugin")
    ap.add_argument("-o", "--output", type=Path, metavar="DIR",
                    help="where to put the libraries (then pass it as EngineConfig.plugin_dir / --plugin-dir); "
                         "default: this user's cache, where the runtime looks")
    ap.add_argument("--dry-run", action="store_true", help="print the nvcc / cmake commands, run nothing")
    ap.add_argument("--print-sources", action="store_true", help="print the plugin source directory and exit")
    args = ap.parse_args(argv)
    try:
        if args.print_sources:
            print(sources())
            return 0
        archs = [arch_number(a) for a in args.arch]
        built = build(archs, args.output, args.tensorrt_include, args.dry_run)
    except (ValueError, PluginBuildError, OSError) as e:
        print(f"tinyserve-build-plugin: error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USAGE
    if not args.dry_run:
        for path in built:
            print(f"built {path}")
        if args.tensorrt_include is None:
            print("the TensorRT plugin was not built: pass --tensorrt-include DIR (TensorRT's include/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
