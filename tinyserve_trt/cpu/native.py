"""Build and load ``libtinyserve_cpu.so``: the op's decode step as an ONNX Runtime custom op.

The library (``csrc/qsa_decode_cpu.cpp``) registers ``tinyserve.cpu::QueryAwareSparseAttentionDecode``
(``DOMAIN``, ``OP_TYPE``) and exports ``tinyserve_append_bounds`` and ``tinyserve_page_bounds``
(``csrc/qsa_append.cpp``, loaded with ctypes by ``append.py``). The C++ contract headers it shares
with the CUDA kernels exist once, in ``plugins/`` (``SHARED_HEADERS``: the schema header generated from ops/schema.py, the element math
and the selection math); the build takes them with ``-I`` from a source checkout's ``plugins/`` or
an installed wheel's copy of it, ``tinyserve_trt/cuda/plugin_sources/`` (:func:`include_dirs`).
It is compiled on first use with the host C++ compiler
(``$CXX``, else ``c++``) for this machine's CPU (``-march=native``; ``EngineConfig.native_arch``, or
``TINYSERVE_NATIVE_ARCH`` where there is no config, names another ``-march`` target, e.g. ``x86-64-v2`` or
``armv8-a`` for a cache shared by several CPUs), into
``$TINYSERVE_CACHE/native/<key>/`` (default ``~/.cache/tinyserve``); the key hashes the
sources (the shared headers too), the compiler's version and flags, the ``-march`` target, the machine and the CPU's
flags, so a cache shared between machines never hands one CPU another's build. What the cache
holds is code: its directories are made mode 0700, and one another user owns or can write is
refused (``private_dir``); a cached library that does not load is rebuilt once, then
NativeUnavailable (the runtime loads the portable graph) - unless the wheel ships a prebuilt
baseline library (``setup.py``: ``prebuilt/libtinyserve_cpu.abi<ABI_VERSION>.<machine>.so``), which is
used where this machine cannot compile (no AVX2 paths: slower than the JIT build, still one node).
The build writes a fresh temporary
file and renames it into place, so concurrent processes are safe. ``TINYSERVE_NATIVE=0``
disables it; ``TINYSERVE_NATIVE_POOL=own`` runs its parallel work on its own threads instead of the
session's intra-op pool (the library reads it, and ``TINYSERVE_NATIVE_THREADS``, once per process). Python-light: no numpy or onnxruntime import here.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

DOMAIN = "tinyserve.cpu"
OP_TYPE = "QueryAwareSparseAttentionDecode"
LAYER_OP_TYPE = "QueryAwareSparseAttentionLayer"  # the op with its layer's head split / rotary / transposes
LIBRARY_NAME = "libtinyserve_cpu.so"
SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = ("qsa_decode_cpu.cpp", "qsa_layer_cpu.cpp", "qsa_append.cpp")  # compiled; the headers next to it are hashed too
# Where plugins/ is: an installed wheel's copy (setup.py), else a source checkout's (an editable install).
_PACKAGE_DIR = Path(__file__).resolve().parents[1]
PLUGIN_SOURCE_ROOTS = (_PACKAGE_DIR / "cuda" / "plugin_sources", _PACKAGE_DIR.parent / "plugins")
INCLUDE_SUBDIRS = ("generated", "kernels")  # the -I directories, under a plugin source root
# The headers of plugins/ the node includes (and hashes into its cache key); tests/cpu holds the
# list to the sources' includes and each header to one copy in the tree.
SHARED_HEADERS = ("generated/qsa_schema.h", "kernels/qsa_math.h", "kernels/qsa_select_math.h")
# -ffp-contract=off: the sub-page bound decode must round like ops/fine_bounds.py (the dot
# products use explicit FMA instead). -fno-math-errno: expf without glibc's error bookkeeping
# (fetestexcept was ~5% of the kernel's time).
CXXFLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17", "-fvisibility=hidden")
ENV_DISABLE = "TINYSERVE_NATIVE"
# The wheel's prebuilt library (setup.py), for machines without a C++ compiler: built for a baseline CPU
# of the architecture (no AVX2 / FMA: the generic paths tests/cpu/test_native_portable.py checks), its
# C ABI version in the file name. Bump ABI_VERSION when the node's inputs, attributes or domain, or an
# exported function (SYMBOLS), change: a library of another version is then not picked up.
ABI_VERSION = 3  # = cpu/node.VERSION (3: prefill too); test_native_prebuilt holds them equal
PREBUILT_DIR_NAME = "prebuilt"
PREBUILT_DIR = Path(__file__).resolve().parent / PREBUILT_DIR_NAME
PREBUILT_MARCH = {"x86_64": "x86-64", "AMD64": "x86-64", "aarch64": "armv8-a", "arm64": "armv8-a"}
ENV_ARCH = "TINYSERVE_NATIVE_ARCH"
ENV_CACHE = "TINYSERVE_CACHE"
# what ORT and append.py look up
SYMBOLS = ("RegisterCustomOps", "tinyserve_append_bounds", "tinyserve_page_bounds")
log = logging.getLogger("tinyserve.cpu")


class NativeUnavailable(RuntimeError):
    """The native library cannot be built or is disabled; the message is one line saying why."""


def compiler() -> str:
    """The C++ compiler command: ``$CXX`` or ``c++``."""
    return os.environ.get("CXX") or "c++"


def cache_root() -> Path:
    """``$TINYSERVE_CACHE``, else ``~/.cache/tinyserve``: this user's build and engine caches."""
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "tinyserve")


class CacheDirError(RuntimeError):
    """A cache directory that another user could write (or that cannot be made); one line."""


def private_dir(root: Path, *parts: str) -> Path:
    """``root / parts...``, each level a directory only this user can write: made with mode 0700
    when missing, else it must be owned by this user and not group- or world-writable (what we
    load from a cache is code, so a cache another user can write is refused, not used as is).
    Raises CacheDirError naming the directory and ``$TINYSERVE_CACHE``."""
    path = Path(root)
    for level in (None, *parts):
        path = path if level is None else path / level
        try:
            if level is None:
                os.makedirs(path.parent, exist_ok=True)
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise CacheDirError(f"cannot make the cache directory {path}: {e.strerror} (set {ENV_CACHE})") from None
        try:
            st = os.stat(path)
        except OSError as e:
            raise CacheDirError(f"cannot read the cache directory {path}: {e.strerror} (set {ENV_CACHE})") from None
        if not stat.S_ISDIR(st.st_mode):
            raise CacheDirError(f"the cache directory {path} is not a directory (set {ENV_CACHE})")
        if st.st_uid != os.geteuid():
            raise CacheDirError(f"the cache directory {path} is owned by another user; not used (set {ENV_CACHE})")
        if st.st_mode & 0o022:
            raise CacheDirError(f"the cache directory {path} is writable by other users "
                                f"(mode {stat.S_IMODE(st.st_mode):o}); not used (chmod go-w it or set {ENV_CACHE})")
    return path


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def arch(march: str | None = None) -> str:
    """The ``-march`` target: ``march`` (``EngineConfig.native_arch``), else ``$TINYSERVE_NATIVE_ARCH``
    (the documented override for tools without a config, e.g. the exporter), else ``native``."""
    name = "native_arch" if march else ENV_ARCH
    value = (march or os.environ.get(ENV_ARCH, "")).strip() or "native"
    if not is_march_name(value):
        raise NativeUnavailable(f"{name}={value!r} is not a -march target name")
    return value


def is_march_name(value: str) -> bool:
    """Whether ``value`` can be a ``-march`` target (letters, digits, ``_.+-``; never a shell word)."""
    return bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", value))


def build_key(cxx: str, cxx_version: str, sources: dict[str, bytes], machine: str, cpu_flags: str,
              march: str = "native") -> str:
    """The cache key of one build: every input that can change the binary."""
    h = hashlib.sha256()
    for name in sorted(sources):
        h.update(name.encode() + b"\0" + sources[name] + b"\0")
    for part in (cxx, cxx_version, machine, hashlib.sha256(cpu_flags.encode()).hexdigest(), " ".join(CXXFLAGS),
                 march):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:24]


def plugin_source_root() -> Path:
    """The ``plugins/`` tree the shared headers come from: the first of ``PLUGIN_SOURCE_ROOTS`` holding
    every one of ``SHARED_HEADERS``; NativeUnavailable (one line, both places) when neither does."""
    for root in PLUGIN_SOURCE_ROOTS:
        if all((root / h).is_file() for h in SHARED_HEADERS):
            return root
    raise NativeUnavailable(f"the shared C++ headers ({', '.join(SHARED_HEADERS)}) are in neither "
                            f"{' nor '.join(map(str, PLUGIN_SOURCE_ROOTS))}; reinstall tinyserve-trt")


def include_dirs() -> tuple[Path, ...]:
    """The ``-I`` directories of the build: ``INCLUDE_SUBDIRS`` of :func:`plugin_source_root`."""
    root = plugin_source_root()
    return tuple(root / d for d in INCLUDE_SUBDIRS)


def _source_files(source_dir: Path) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in sorted(source_dir.iterdir()) if p.suffix in (".cpp", ".h")}
    root = plugin_source_root()
    return {**files, **{f"plugins/{h}": (root / h).read_bytes() for h in SHARED_HEADERS}}


def _compiler_version(cxx: str) -> str:
    if shutil.which(cxx) is None:
        raise NativeUnavailable(f"no C++ compiler: {cxx!r} is not on PATH (set CXX)")
    res = subprocess.run([cxx, "--version"], capture_output=True, text=True)
    if res.returncode:
        raise NativeUnavailable(f"{cxx} --version failed: {_first_line(res.stderr)}")
    return res.stdout


def _first_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln]
    return (errors or lines or ["(no output)"])[0].strip()


def library_file(source_dir: Path = SOURCE_DIR, root: Path | None = None, march: str | None = None) -> Path:
    """Where :func:`build` keeps the library of this key (``<root>/native/<key>/``); builds and checks nothing."""
    cxx = compiler()
    key = build_key(cxx, _compiler_version(cxx), _source_files(source_dir), platform.machine(), _cpu_flags(),
                    arch(march))
    return (root or cache_root()) / "native" / key / LIBRARY_NAME


def build(source_dir: Path = SOURCE_DIR, root: Path | None = None, march: str | None = None) -> Path:
    """The library for ``-march=march`` (default: ``arch()``): the cached one when it loads, else
    compiled (once) into the cache; return its path. The cache directories must be private
    (:func:`private_dir`); a cached library that does not load (:func:`unloadable`) is rebuilt,
    and one that still does not is NativeUnavailable - the runtime then runs the portable graph."""
    cxx = compiler()
    march = arch(march)
    lib = library_file(source_dir, root, march)
    try:
        private_dir(root or cache_root(), "native", lib.parent.name)
    except CacheDirError as e:
        raise NativeUnavailable(f"cannot write the build cache: {e}") from None
    if os.path.lexists(lib):
        reason = unloadable(lib)
        if reason is None:
            return lib
        log.warning("%s %s; rebuilding it", lib, reason)
    _build_into(cxx, march, source_dir, lib)
    reason = unloadable(lib)
    if reason is not None:
        raise NativeUnavailable(f"{lib} was rebuilt but {reason}")
    return lib


def _build_into(cxx: str, march: str, source_dir: Path, lib: Path) -> None:
    """Compile into a fresh temp file beside ``lib`` and rename it onto ``lib`` (atomic: a concurrent
    build of the same key writes identical bytes; nothing partial is left behind)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=lib.parent)
    except OSError as e:
        raise NativeUnavailable(f"cannot write the build cache {lib.parent}: {e.strerror} (set {ENV_CACHE})") from None
    os.close(fd)
    try:
        _compile(cxx, march, source_dir, tmp)
        os.replace(tmp, lib)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def compile_command(cxx: str, march: str, source_dir: Path, out: str) -> list[str]:
    """The compiler command line that builds ``out`` from ``source_dir``'s ``SOURCES``."""
    return [cxx, *CXXFLAGS, f"-march={march}", *(f"-I{d}" for d in include_dirs()), "-o", out,
            *(str(source_dir / s) for s in SOURCES)]


def _compile(cxx: str, march: str, source_dir: Path, out: str) -> None:
    cmd = compile_command(cxx, march, source_dir, out)
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise NativeUnavailable(f"compiling {LIBRARY_NAME} failed: {_first_line(res.stderr)}")


def unloadable(lib: Path) -> str | None:
    """None when ``lib`` is a regular file of this user that no one else can write and that loads
    with the symbols we call (``SYMBOLS``); else why not (one line). Loading it runs no code of
    ours but its static initializers - the same as registering it."""
    try:
        st = os.lstat(lib)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return "is writable by another user"
    try:
        handle = ctypes.CDLL(str(lib))
    except OSError as e:
        return f"cannot be loaded ({_first_line(str(e))[:200]})"
    missing = [name for name in SYMBOLS if not hasattr(handle, name)]
    return f"cannot be loaded (it lacks {', '.join(missing)})" if missing else None


_BUILT: dict[str, Path] = {}  # -march target -> this process's library for it, once one loaded


def prebuilt_name(machine: str | None = None) -> str:
    return f"libtinyserve_cpu.abi{ABI_VERSION}.{machine or platform.machine()}.so"


def build_prebuilt(out: Path) -> Path:
    """Compile the wheel's prebuilt library (``PREBUILT_MARCH`` of this machine) into ``out`` (setup.py);
    NativeUnavailable when there is no compiler or no baseline target for this architecture."""
    march = PREBUILT_MARCH.get(platform.machine())
    if march is None:
        raise NativeUnavailable(f"no baseline -march for {platform.machine()}")
    cxx = compiler()
    _compiler_version(cxx)
    Path(out).mkdir(parents=True, exist_ok=True)
    lib = Path(out) / prebuilt_name()
    tmp = lib.with_name(lib.name + ".tmp")
    try:
        _compile(cxx, march, SOURCE_DIR, str(tmp))
        os.replace(tmp, lib)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return lib


def prebuilt_library(directory: Path | None = None) -> tuple[Path | None, str]:
    """(the installed prebuilt library, "") when this install has one that loads, else (None, why not).
    It is part of the installed package, so it may be owned by root (a system install) but never
    writable by another user."""
    lib = (directory or PREBUILT_DIR) / prebuilt_name()
    try:
        st = os.lstat(lib)
    except OSError:
        return None, "no prebuilt library in this install"
    if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
        return None, f"the prebuilt {lib} is not a regular file of this user or root, writable by no one else"
    try:
        handle = ctypes.CDLL(str(lib))
    except OSError as e:
        return None, f"the prebuilt {lib} cannot be loaded ({_first_line(str(e))[:200]})"
    missing = [name for name in SYMBOLS if not hasattr(handle, name)]
    if missing:
        return None, f"the prebuilt {lib} lacks {', '.join(missing)}"
    return lib, ""


def library_path(march: str | None = None) -> Path:
    """Path of the library for ``-march=march`` (default: :func:`arch`): this machine's JIT build (built
    on the first call), else the wheel's prebuilt baseline library (:func:`prebuilt_library`) when the
    JIT build cannot run here (no compiler, say). Raises NativeUnavailable naming both reasons."""
    if os.environ.get(ENV_DISABLE, "1").strip() == "0":
        raise NativeUnavailable(f"the native CPU op is disabled ({ENV_DISABLE}=0)")
    target = arch(march)
    if target not in _BUILT:
        try:
            _BUILT[target] = build(march=target)
        except NativeUnavailable as e:
            lib, why = prebuilt_library()
            if lib is None:
                raise NativeUnavailable(f"{e}; {why}") from None
            log.info("the native CPU op cannot be built here (%s); using the prebuilt %s", e, lib)
            _BUILT[target] = lib
    return _BUILT[target]


def available(march: str | None = None) -> str | None:
    """None when the native op can be used, else the one-line reason it cannot."""
    try:
        library_path(march)
    except NativeUnavailable as e:
        return str(e)
    return None


def register(session_options, march: str | None = None) -> Path:
    """Register the library's custom ops on an ``onnxruntime.SessionOptions`` and return its path;
    NativeUnavailable (one line) when ONNX Runtime refuses it."""
    lib = library_path(march)
    try:
        session_options.register_custom_ops_library(str(lib))
    except Exception as e:  # ORT's Fail: a library it cannot load or whose ops it rejects
        raise NativeUnavailable(f"ONNX Runtime cannot register {lib}: {_first_line(str(e))[:200]}") from None
    return lib
