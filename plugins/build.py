#!/usr/bin/env python3
"""Build libqsa_kernels.so (the CUDA kernels, extern "C" launchers) with nvcc.

One command, no CMake needed (the GPU check machine may lack it):
    python plugins/build.py                 # all archs below, into build/plugins/
    python plugins/build.py --arch 90       # one arch, fast
    python plugins/build.py --check         # compile only (-c), no library: what CI runs
    python plugins/build.py --emulate       # g++ CPU emulation (plugins/emulation), into build/plugins/emulated/
    python plugins/build.py --emulate --sanitize address   # the same under AddressSanitizer
nvcc is taken from $CUDACXX, then PATH, then the PyPI ``nvidia-cuda-nvcc`` wheel;
the emulated build needs only g++ >= 12 ($CXX, else g++): the same kernel sources,
compiled as C++20 against plugins/emulation/ instead of the CUDA headers.
The TensorRT plugin needs TensorRT headers and is built by CMake instead
(plugins/README.md). Keep ARCHS equal to plugins/CMakeLists.txt (a test checks).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SOURCES = sorted((HERE / "kernels").glob("*.cu"))
EMULATION = HERE / "emulation"
EMULATED_OUT = ROOT / "build" / "plugins" / "emulated"
ARCHS = ("75", "80", "86", "87", "89", "90")  # + PTX of the last, for newer GPUs to JIT


def find_nvcc() -> str:
    """nvcc from $CUDACXX, PATH, or the nvidia-cuda-nvcc wheel; raises with what was tried."""
    tried = []
    env = os.environ.get("CUDACXX")
    if env:
        if Path(env).is_file():
            return env
        tried.append(f"$CUDACXX={env}")
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    tried.append("PATH")
    try:
        import nvidia.cuda_nvcc as wheel  # PyPI nvidia-cuda-nvcc(-cu12)
        for base in getattr(wheel, "__path__", []):
            cand = Path(base) / "bin" / "nvcc"
            if cand.is_file():
                return str(cand)
        tried.append("nvidia.cuda_nvcc wheel (no bin/nvcc)")
    except ImportError:
        tried.append("nvidia.cuda_nvcc wheel (not installed)")
    raise SystemExit(f"build.py: no nvcc found (tried {', '.join(tried)})")


def supported_archs(nvcc: str) -> set[str]:
    """Real archs this nvcc can target (``--list-gpu-arch`` prints compute_XX)."""
    out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True)
    if out.returncode != 0:
        return set(ARCHS)  # older nvcc without the flag: assume the list is fine
    return {line.strip().removeprefix("compute_") for line in out.stdout.split() if line.startswith("compute_")}


def gencode_flags(archs, nvcc: str) -> list[str]:
    have = supported_archs(nvcc)
    dropped = [a for a in archs if a not in have]
    if dropped:
        print(f"build.py: this nvcc cannot target sm_{', sm_'.join(dropped)}; skipping them", file=sys.stderr)
    keep = sorted((a for a in archs if a in have), key=int)
    if not keep:
        raise SystemExit(f"build.py: none of {archs} is supported by {nvcc}")
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in keep]
    flags.append(f"-gencode=arch=compute_{keep[-1]},code=compute_{keep[-1]}")
    return flags


def nvcc_command(nvcc: str, archs) -> list[str]:
    """nvcc and the flags every kernel source compiles with, for ``archs`` (e.g. ``("87",)``)."""
    return [nvcc, "-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-lineinfo", f"-I{HERE / 'kernels'}",
            *gencode_flags(tuple(archs), nvcc)]


def library_command(nvcc: str, archs, lib: Path) -> list[str]:
    """The one nvcc line that links ``lib`` (libqsa_kernels.so) from every kernel source; also what
    ``tinyserve-build-plugin`` (tinyserve_trt/cuda/plugin_build.py) runs from an installed package."""
    return [*nvcc_command(nvcc, archs), "-shared", *map(str, SOURCES), "-o", str(lib)]


def emulated_inputs() -> list[Path]:
    """Every file the emulated library is built from (for the staleness check)."""
    return [*SOURCES, *(HERE / "kernels").glob("*.h*"), *(HERE / "kernels").glob("*.cuh"),
            *(HERE / "generated").glob("*.h"), *EMULATION.rglob("*.h"), *EMULATION.rglob("*.cuh"),
            *EMULATION.glob("*.cpp")]


def build_emulated(out: Path, sanitize: str | None = None, if_stale: bool = False) -> Path:
    """g++ build of the kernels against plugins/emulation: libqsa_kernels.so in ``out``.

    Each translation unit compiles in its own process (two at a time), then one link.
    ``if_stale``: do nothing when the library is newer than every input.
    """
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        raise SystemExit("build.py: no g++ found (set $CXX): the emulated build needs a C++20 compiler")
    out.mkdir(parents=True, exist_ok=True)
    lib = out / "libqsa_kernels.so"
    if if_stale and lib.is_file() and lib.stat().st_mtime >= max(p.stat().st_mtime for p in emulated_inputs()):
        return lib
    # -ffp-contract=off: as __fmul_rn/__fadd_rn on a GPU, no a * b + c becomes an FMA (two-level
    # selection decodes its sub-page bounds bit-exactly like ops/fine_bounds.py)
    flags = [cxx, "-std=c++20", "-fPIC", "-pthread", "-Wall", "-Wno-unknown-pragmas", "-ffp-contract=off",
             f"-I{EMULATION / 'include'}",
             f"-I{HERE / 'kernels'}"]
    flags += ["-O1", "-g", f"-fsanitize={sanitize}", "-fno-omit-frame-pointer"] if sanitize else ["-O2"]
    units = [*SOURCES, EMULATION / "cuda_emu.cpp"]

    def compile_one(src: Path) -> Path:
        obj = out / (src.stem + ".o")
        subprocess.run([*flags, "-x", "c++", "-c", str(src), "-o", str(obj)], check=True)
        return obj

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        objs = list(pool.map(compile_one, units))
    tmp = out / (lib.name + ".tmp")  # rename into place: a concurrent loader never sees half a file
    subprocess.run([*flags, "-shared", *map(str, objs), "-o", str(tmp)], check=True)
    tmp.replace(lib)
    print(f"built {lib} (CPU emulation{', ' + sanitize + ' sanitizer' if sanitize else ''})")
    return lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", help="SM arch like 90 (repeatable); default: all of ARCHS")
    ap.add_argument("--out", help="output directory (default build/plugins, or build/plugins/emulated[-SAN])")
    ap.add_argument("--check", action="store_true", help="compile each source to an object only")
    ap.add_argument("--emulate", action="store_true", help="g++ build for the CPU emulation (no nvcc, no GPU)")
    ap.add_argument("--sanitize", choices=("address", "undefined", "thread"), help="with --emulate: a sanitizer")
    ap.add_argument("--if-stale", action="store_true", help="with --emulate: skip when the library is up to date")
    args = ap.parse_args(argv)
    if args.sanitize and not args.emulate:
        ap.error("--sanitize needs --emulate")
    if args.emulate:
        default = EMULATED_OUT.with_name(f"emulated-{args.sanitize}") if args.sanitize else EMULATED_OUT
        build_emulated(Path(args.out or default), args.sanitize, args.if_stale)
        return 0
    args.out = args.out or str(ROOT / "build" / "plugins")
    nvcc = find_nvcc()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = nvcc_command(nvcc, tuple(args.arch or ARCHS))
    if args.check:
        for src in SOURCES:
            cmd = [*common, "-c", str(src), "-o", str(out / (src.stem + ".o"))]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        return 0
    lib = out / "libqsa_kernels.so"
    cmd = library_command(nvcc, tuple(args.arch or ARCHS), lib)
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    print(f"built {lib}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
