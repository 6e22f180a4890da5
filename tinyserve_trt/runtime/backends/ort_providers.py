"""Which ONNX Runtime execution provider runs a package, and what it is handed.

  cpu       CPUExecutionProvider; pages in host memory (numpy), shared with ORT.
  cuda      CUDAExecutionProvider (onnxruntime-gpu); pages on the GPU (DevicePages).
            The model's local functions are inlined first (ORT #27873: CUDA EP session
            creation can fail before they are inlined); the inlined copy is cached
            beside the package (``model.inlined.onnx``, written by rename from a fresh
            temp file: a link the package ships under that name is replaced, never followed).
  tensorrt  TensorrtExecutionProvider with our plugin library
            (``trt_extra_plugin_lib_paths``): TensorRT's ONNX parser imports the op
            node (it carries ``plugin_namespace``) as the plugin, so ORT users get the
            CUDA kernels without TensorRT code of their own. Nodes TensorRT does not
            take run on the CUDA EP (the op's model-local function is the fallback
            there), the rest on the CPU EP. Pages on the GPU, as for ``cuda``. Engines are
            code: TensorRT's engine cache is this user's (``~/.cache/tinyserve/trt_ep_cache``),
            the package's ``trt_ep_cache`` only with ``trust_package_engines``.
  auto      ``cuda`` when onnxruntime-gpu sees a GPU and torch has CUDA (the pages
            need it), else ``cpu``.

Every missing piece is a one-line RuntimeError naming what to install or build;
an explicit choice never falls back silently.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path

from tinyserve_trt.contracts.engine_profiles import engine_profiles
from tinyserve_trt.runtime.config import ORT_PROVIDERS as PROVIDERS  # defined once, with EngineConfig

EP_NAMES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
            "tensorrt": "TensorrtExecutionProvider"}
INLINED_FILE = "model.inlined.onnx"
TRT_CACHE_DIR = "trt_ep_cache"  # the package's own (trust_package_engines), or this user's


def check_provider(kind: str) -> None:
    if kind not in PROVIDERS:
        raise ValueError(f"ort provider must be one of {PROVIDERS}, got {kind!r}")


def torch_cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_provider(ort, kind: str) -> str:
    """``kind`` with ``auto`` resolved; RuntimeError when a GPU kind cannot run here."""
    check_provider(kind)
    available = ort.get_available_providers()
    if kind == "auto":
        try:
            gpu = "CUDAExecutionProvider" in available and ort.get_device() == "GPU"
        except Exception:  # no driver
            gpu = False
        return "cuda" if gpu and torch_cuda_available() else "cpu"
    if kind == "cpu":
        return kind
    if EP_NAMES[kind] not in available:
        raise RuntimeError(f"ONNX Runtime has no {EP_NAMES[kind]} here (available: {', '.join(available)}); "
                           "install onnxruntime-gpu (pip install 'tinyserve-trt[gpu]') in place of onnxruntime")
    if not torch_cuda_available():
        raise RuntimeError(f"--ort-provider {kind} keeps the KV pages on the GPU as torch tensors: "
                           "install a CUDA build of torch and check that torch.cuda.is_available()")
    return kind


def plugin_path(plugin_dir: str | None = None) -> Path:
    """Our TensorRT plugin library (``cuda.plugin.plugin_library``: ``plugin_dir``, ``$TINYSERVE_TRT_PLUGIN``,
    tinyserve-build-plugin's default cache, a checkout's build/plugins/)."""
    from tinyserve_trt.cuda.plugin import TensorRTUnavailable, plugin_library

    try:
        return plugin_library(plugin_dir)
    except TensorRTUnavailable as e:
        raise RuntimeError(str(e)) from None


def tensorrt_options(package, device_id: int, plugin: Path, trust_package_engines: bool = False) -> dict:
    """TensorRT EP options: the plugin library, fp16 for an fp16 package, an engine cache, and
    the export's shape profiles (so engines are not rebuilt every time a batch or page table grows).

    Engines are code, so the cache is this user's (``engine_cache_dir``) unless
    ``trust_package_engines``: then the package's own ``trt_ep_cache`` (engines shipped with it)."""
    if trust_package_engines:
        from tinyserve_trt.contracts.package_paths import resolve_inside

        cache = resolve_inside(package.path, TRT_CACHE_DIR, TRT_CACHE_DIR)  # a link out of the package: refused
    else:
        cache = engine_cache_dir(package.path)
    opts = {"device_id": device_id, "trt_extra_plugin_lib_paths": str(plugin),
            "trt_fp16_enable": package.dtype == "float16", "trt_engine_cache_enable": True,
            "trt_engine_cache_path": str(cache)}
    try:
        profiles, _ = engine_profiles(package.manifest, package.max_context)
    except (KeyError, TypeError, AttributeError):  # a manifest without io names: TensorRT picks shapes
        return opts
    for i, key in enumerate(("trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes")):
        opts[key] = ",".join(f"{name}:{'x'.join(map(str, shapes[i]))}" for name, shapes in profiles.items())
    return opts


def engine_cache_dir(package_path: Path) -> Path:
    """This user's TensorRT EP engine cache for one package: ``$TINYSERVE_CACHE/trt_ep_cache/<hash of
    the package's real path>``, made mode 0700 (one RuntimeError when another user could write it)."""
    from tinyserve_trt.cpu.native import cache_root, private_dir

    key = hashlib.sha256(os.path.realpath(package_path).encode()).hexdigest()[:24]
    return private_dir(cache_root(), TRT_CACHE_DIR, key)


def provider_list(kind: str, package, device_id: int = 0, trust_package_engines: bool = False,
                  plugin_dir: str | None = None) -> list:
    """The ``providers`` argument of ``InferenceSession`` for a resolved ``kind``."""
    cuda = ("CUDAExecutionProvider", {"device_id": device_id})
    if kind == "cpu":
        return ["CPUExecutionProvider"]
    if kind == "cuda":
        return [cuda, "CPUExecutionProvider"]
    trt = ("TensorrtExecutionProvider", tensorrt_options(package, device_id, plugin_path(plugin_dir),
                                                         trust_package_engines))
    return [trt, cuda, "CPUExecutionProvider"]


def inlined_model(model_path: Path):
    """``model_path`` with its model-local functions inlined, for the CUDA EP (ORT #27873).

    Cached as ``model.inlined.onnx`` beside it (external data stays where it is: the
    copy refers to the same files) and rebuilt when the source is newer. The cache is
    used only when it is a regular file of this user (never a link the package ships);
    it is written to a fresh temp file (``mkstemp``: O_EXCL, never through a link) and
    renamed over the name, which replaces an entry there rather than writing through it.
    A read-only package is inlined in memory: the serialized bytes come back instead of a path.
    """
    import onnx
    from onnx.inliner import inline_local_functions

    model_path = Path(model_path)
    cached = model_path.with_name(INLINED_FILE)
    if _own_fresh_file(cached, model_path):
        return cached
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as e:  # google.protobuf DecodeError and the like: bytes that are not a model
        raise load_error(model_path, e) from None
    if not model.functions:
        return model_path
    inlined = inline_local_functions(model)
    if os.access(model_path.parent, os.W_OK):
        try:
            write_replace(cached, inlined.SerializeToString())
            return cached
        except OSError:  # e.g. a full disk: inline in memory instead
            pass
    try:
        full = onnx.load(str(model_path))  # read-only package: external data loaded, inlined in memory
    except Exception as e:
        raise load_error(model_path, e) from None
    return inline_local_functions(full).SerializeToString()


def _own_fresh_file(cached: Path, source: Path) -> bool:
    """Whether ``cached`` is a regular file (not a link) owned by this user and not older than ``source``."""
    try:
        st = os.lstat(cached)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mtime >= source.stat().st_mtime


def write_replace(path: Path, data: bytes) -> None:
    """Write ``data`` to a fresh temp file beside ``path`` and rename it onto ``path`` (atomic: a
    concurrent reader or writer sees the old file or the new one; the temp file is removed on failure)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def first_line(error: Exception) -> str:
    """The first line of ``error``'s message, whitespace collapsed, at most 200 characters."""
    return " ".join((str(error).strip().splitlines() or [type(error).__name__])[0].split())[:200]


def load_error(path: Path, error: Exception):
    """The one-line PackageError for a model file that ONNX / ONNX Runtime cannot parse or load."""
    from tinyserve_trt.contracts.manifest import PackageError

    return PackageError(f"{path}: cannot load the model ({first_line(error)}); the package is damaged or was "
                        "written for another version: re-export it with tinyserve-export")


def session_error(kind: str, model, error: Exception, inlined: bool = True) -> RuntimeError:
    """One line for a GPU session that ONNX Runtime refused, naming the fix."""
    first = first_line(error)
    where = model if isinstance(model, (str, Path)) else "the inlined model"
    if kind == "cuda" and not inlined:
        fix = ("inline the model-local functions before the CUDA EP sees the model (ORT #27873): "
               "onnx.inliner.inline_local_functions, which the backend does unless inline=False")
    elif kind == "cuda":
        fix = ("the model's functions were already inlined (ORT #27873), so check the onnxruntime-gpu / CUDA / "
               "cuDNN versions; --ort-provider cpu runs without a GPU")
    else:
        fix = ("check the plugin library and the TensorRT EP log (TensorRT libraries on the library path); "
               "--ort-provider cuda runs without TensorRT")
    return RuntimeError(f"ONNX Runtime could not start the {EP_NAMES[kind]} on {where}: {first}; fix: {fix}")
