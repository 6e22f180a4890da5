"""ctypes view of ``libqsa_kernels.so`` (plugins/kernels/qsa_launch.h).

The structs below are built from ``launch_abi.py``, the definition the C header's
structs are generated from; ``tests/kernels/test_launch_abi.py`` still compiles the
header with the host C compiler and checks every offset.
Loading the library needs no GPU; calling it does.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..ops import policies, schema
from . import launch_abi

DEFAULT_LIB = Path(__file__).resolve().parents[2] / "build" / "plugins" / "libqsa_kernels.so"  # a checkout's build
# The same kernel sources built by g++ against plugins/emulation (host memory, no GPU).
EMULATED_LIB = DEFAULT_LIB.parent / "emulated" / "libqsa_kernels.so"
LIB_ENV = "TINYSERVE_QSA_LIB"  # an override (one file); tinyserve-build-plugin's output is found without it

QSA_OK = 0
STATUS_NAMES = {0: "ok", 1: "invalid argument", 2: "unsupported", 3: "workspace too small", 4: "CUDA launch failed",
                5: "page id outside the pools", 6: "sequence needs more pages than the page table holds"}
# Bits the kernels set in ``error_flags`` (qsa_launch.h QSA_FLAG_*) and the status each stands for.
FLAG_STATUS = {1: 5, 2: 6}
DTYPES = {"float32": 0, "float16": 1}
POLICY_IDS = schema.POLICY_IDS  # the generated header's QSA_POLICY_*: only the policies C knows
CUDA_POLICIES = policies.implemented_by("cuda")  # qsa_api.cu's policy_supported; the others are refused
GROUP_REDUCE_IDS = {name: i for i, name in enumerate(schema.GROUP_REDUCTIONS)}
# the group reductions a CUDA decode step runs: all of them ("head": a selection unit per query head,
# qsa_common.cuh::select_unit; checked in the CPU emulation only, never on a GPU yet)
CUDA_GROUP_REDUCTIONS = tuple(schema.GROUP_REDUCTIONS)
COLD_FORMAT_IDS = {name: i for i, name in enumerate(schema.COLD_FORMATS)}

# ctypes mirrors of qsa_launch.h's structs, built from the definition the C ones are generated from
# (launch_abi.py -> plugins/generated/qsa_launch_structs.h): no field is typed twice.
_i32, _f32, _vp = ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
_SCALARS = {"int32_t": _i32, "float": _f32}
_STRUCTS: dict[str, type[ctypes.Structure]] = {}


def _ctype(ctype: str):
    if ctype.endswith("*"):
        return ctypes.c_void_p
    return _SCALARS.get(ctype) or _STRUCTS[ctype]


for _s in launch_abi.STRUCTS:
    _STRUCTS[_s.name] = type(_s.name, (ctypes.Structure,), {
        "_fields_": [(f.name, _ctype(f.ctype)) for f in _s.fields], "__doc__": _s.doc, "__module__": __name__})
QsaDims, QsaAttrs, QsaColdDims = _STRUCTS["QsaDims"], _STRUCTS["QsaAttrs"], _STRUCTS["QsaColdDims"]
QsaForwardParams, QsaAppendParams = _STRUCTS["QsaForwardParams"], _STRUCTS["QsaAppendParams"]

FORWARD_POINTERS = launch_abi.pointer_fields(launch_abi.QSA_FORWARD_PARAMS)
COLD_POINTERS = schema.COLD_INPUTS  # key_cache_int8, value_cache_int8, key_scale, value_scale
APPEND_POINTERS = launch_abi.pointer_fields(launch_abi.QSA_APPEND_PARAMS)


class KernelError(RuntimeError):
    """A launcher returned a non-OK QsaStatus."""

    def __init__(self, status: int, what: str):
        super().__init__(f"{what}: status {status} ({STATUS_NAMES.get(status, 'unknown')})")
        self.status = status


def flags_status(flags: int) -> int:
    """The QsaStatus that a call's ``error_flags`` word stands for (QSA_OK when 0)."""
    for bit, status in FLAG_STATUS.items():
        if flags & bit:
            return status
    return QSA_OK


def check_flags(flags: int, what: str) -> None:
    """Raise KernelError when the kernels flagged a bad page id or a full page table."""
    status = flags_status(flags)
    if status != QSA_OK:
        raise KernelError(status, what)


_LIB = None


def library_path(plugin_dir: str | os.PathLike | None = None) -> Path:
    """The kernel library: in ``plugin_dir`` (``EngineConfig.plugin_dir``) when given, else ``$TINYSERVE_QSA_LIB``,
    else where ``tinyserve-build-plugin`` builds by default, else a checkout's ``build/plugins/``
    (``plugin_build.find_library``); the last candidate when none exists (``load`` then says how to build it)."""
    from .plugin_build import KERNELS_LIBRARY, find_library

    try:
        return find_library(KERNELS_LIBRARY, plugin_dir, LIB_ENV)
    except FileNotFoundError:
        if plugin_dir is not None:
            return Path(plugin_dir) / KERNELS_LIBRARY
        return Path(os.environ[LIB_ENV]) if os.environ.get(LIB_ENV) else DEFAULT_LIB


def is_emulated(lib: ctypes.CDLL) -> bool:
    """True for the CPU-emulated build: its pointers are host memory, its launches synchronous."""
    return hasattr(lib, "qsa_emulated")


def use(path: str | os.PathLike) -> ctypes.CDLL:
    """Load the library at ``path`` and make it the one ``load()`` returns from now on."""
    global _LIB
    _LIB = load(path)
    return _LIB


def load(path: str | os.PathLike | None = None, plugin_dir: str | os.PathLike | None = None) -> ctypes.CDLL:
    """Load (once) and type the library (``path``, else :func:`library_path` of ``plugin_dir``); raises
    FileNotFoundError naming the build command."""
    global _LIB
    if _LIB is not None and path is None:
        return _LIB
    p = Path(path) if path else library_path(plugin_dir)
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found: build it with `tinyserve-build-plugin --arch sm_XX` (or, in a "
                                f"checkout, `python plugins/build.py`), or set ${LIB_ENV}")
    lib = ctypes.CDLL(str(p))
    lib.qsa_workspace_size.argtypes = [ctypes.POINTER(QsaDims)]
    lib.qsa_workspace_size.restype = ctypes.c_size_t
    lib.qsa_workspace_kept.argtypes = [ctypes.POINTER(QsaDims), ctypes.POINTER(ctypes.c_size_t),
                                       ctypes.POINTER(ctypes.c_size_t)]
    lib.qsa_workspace_kept.restype = _i32
    lib.qsa_kept_rows.argtypes = [ctypes.POINTER(QsaForwardParams)]
    lib.qsa_kept_rows.restype = _i32
    lib.qsa_num_splits.argtypes = [ctypes.POINTER(QsaDims), _i32, _i32]
    lib.qsa_num_splits.restype = _i32
    lib.qsa_forward_splits.argtypes = [ctypes.POINTER(QsaForwardParams), _i32]
    lib.qsa_forward_splits.restype = _i32
    lib.qsa_check.argtypes = [ctypes.POINTER(QsaForwardParams)]
    lib.qsa_check.restype = _i32
    lib.qsa_forward.argtypes = [ctypes.POINTER(QsaForwardParams), _vp, ctypes.c_size_t, _vp]
    lib.qsa_forward.restype = _i32
    lib.qsa_append_kv.argtypes = [ctypes.POINTER(QsaAppendParams), _vp]
    lib.qsa_append_kv.restype = _i32
    lib.qsa_status_string.argtypes = [_i32]
    lib.qsa_status_string.restype = ctypes.c_char_p
    if path is None:
        _LIB = lib
    return lib


def forward_dims(shapes: Mapping[str, Sequence[int] | None]) -> QsaDims:
    """QsaDims from the input shapes by schema name (query, key, key_cache, key_min, page_table,
    and key_sub_bounds when given: ``sub_pages`` = its r, else 0)."""
    B, H, S, D = shapes["query"]
    P, _, ps, _ = shapes["key_cache"]
    return QsaDims(B, H, shapes["key"][1], S, D, P, ps, shapes["page_table"][1], shapes["key_min"][0],
                   sub_bounds_rows(shapes))


def sub_bounds_rows(shapes: Mapping[str, Sequence[int] | None]) -> int:
    """r of ``key_sub_bounds [Ptot, Hkv, r, D]`` (0 when absent). Checks what the C side cannot
    see (it gets r only): Ptot, Hkv and D agree with ``key_min`` and r divides ps.
    Raises ValueError naming the input."""
    shape = shapes.get("key_sub_bounds")
    if shape is None:
        return 0
    Ptot, Hkv, D = shapes["key_min"]
    ps = shapes["key_cache"][2]
    shape = tuple(shape)
    if len(shape) != 4 or shape[:2] != (Ptot, Hkv) or shape[3] != D or shape[2] < 1 or ps % shape[2]:
        raise ValueError(f"key_sub_bounds must be [Ptot={Ptot}, Hkv={Hkv}, r, D={D}] with r dividing "
                         f"ps={ps}, got {shape}")
    return shape[2]


def cold_dims(shapes: Mapping[str, Sequence[int] | None], cold_format: str = "int8") -> QsaColdDims:
    """QsaColdDims of the optional cold tier; all zero when none of ``COLD_POINTERS`` is given.

    Checks what the C side cannot see (it gets Pcold, the scale extents and the
    format, not the pool shapes): the pools are ``[Pcold, Hkv, ps, D]`` like the hot
    pool (int4: ``D/2`` packed bytes), each scale ``[Pcold, Hkv, 1|ps, C]`` with C in
    {1, D} (int4: C dividing D, ``ops/cold_codec.py``). Raises ValueError naming the input.
    """
    if cold_format not in COLD_FORMAT_IDS:
        raise ValueError(f"cold_format must be one of {tuple(COLD_FORMAT_IDS)}, got {cold_format!r}")
    given = [n for n in COLD_POINTERS if shapes.get(n) is not None]
    if not given:
        return QsaColdDims()
    if len(given) != len(COLD_POINTERS):
        raise ValueError(f"the cold tier needs all of {COLD_POINTERS}, got only {tuple(given)}")
    _, Hkv, ps, D = shapes["key_cache"]
    int4 = cold_format == "int4"
    if int4 and D % 2:
        raise ValueError(f"int4 cold pages need an even head dim, got {D}")
    Dc = D // 2 if int4 else D
    Pcold = shapes["key_cache_int8"][0]
    for n in COLD_POINTERS[:2]:
        if tuple(shapes[n]) != (Pcold, Hkv, ps, Dc):
            raise ValueError(f"{n} must be [Pcold={Pcold}, Hkv={Hkv}, ps={ps}, {Dc}] ({cold_format}), "
                             f"got {tuple(shapes[n])}")
    extents = []
    for n in COLD_POINTERS[2:]:
        shape = tuple(shapes[n])
        pairs = 2 if int4 and n == "value_scale" else 1  # INT4 V: C scales, then C mins (cold_codec format 3)
        C = shape[3] // pairs if len(shape) == 4 and shape[3] % pairs == 0 else 0
        ch_ok = len(shape) == 4 and (C in (1, D) or (int4 and C > 0 and D % C == 0))
        if len(shape) != 4 or shape[:2] != (Pcold, Hkv) or shape[2] not in (1, ps) or not ch_ok:
            chans = (f"2C, C dividing {D}" if pairs == 2 else f"C dividing {D}") if int4 else f"1|{D}"
            raise ValueError(f"{n} must be [Pcold={Pcold}, Hkv={Hkv}, 1|{ps}, {chans}], got {shape}")
        extents += shape[2:]
    return QsaColdDims(Pcold, *extents, COLD_FORMAT_IDS[cold_format])


def forward_params(shapes: Mapping[str, Sequence[int] | None], pointers: Mapping[str, int | None], dtype: str,
                   attrs: schema.OpAttributes, *, num_splits: int = 0,
                   selected_pages_elem_size: int = 1, cold_format: str | None = None) -> QsaForwardParams:
    """Pack one ``qsa_forward`` call: dims, the cold tier and the sub-page rows from ``shapes``,
    device addresses from ``pointers`` (both by schema name; absent = NULL); ``cold_format``
    (``schema.COLD_FORMATS``; default: ``attrs.cold_format``) says how the cold inputs are
    stored. Touches no memory.
    Two-level attributes (``sub_page_size`` not 0 or ps) need ``key_sub_bounds`` with
    ``r = ps / sub_page_size`` rows per page: ValueError otherwise."""
    p = QsaForwardParams()
    p.dims = forward_dims(shapes)
    ps, sp = p.dims.page_size, attrs.sub_page_size
    if sp not in (0, ps):
        if ps % sp:
            raise ValueError(f"sub_page_size {sp} must divide the page size {ps}")
        if p.dims.sub_pages != ps // sp:
            raise ValueError(f"two-level selection (sub_page_size {sp}) needs key_sub_bounds "
                             f"[Ptot, Hkv, {ps // sp}, D], got {shapes.get('key_sub_bounds')}")
    p.cold = cold_dims(shapes, attrs.cold_format if cold_format is None else cold_format)
    p.attrs = make_attrs(attrs)
    p.dtype = DTYPES[dtype]
    p.num_splits = num_splits
    p.selected_pages_elem_size = selected_pages_elem_size
    for name in FORWARD_POINTERS:
        setattr(p, name, pointers.get(name))
    return p


def make_attrs(attrs: schema.OpAttributes) -> QsaAttrs:
    """The launch attributes; ValueError for a policy without a C id (``POLICY_IDS``). A policy with
    an id outside ``CUDA_POLICIES`` is packed: the C API refuses its decode step (QSA_UNSUPPORTED)."""
    if attrs.policy not in POLICY_IDS:
        raise ValueError(f"policy {attrs.policy!r} has no native id (the CUDA kernels know {tuple(POLICY_IDS)}; "
                         "the op's ONNX function runs it)")
    return QsaAttrs(float(attrs.scale), POLICY_IDS[attrs.policy], attrs.sink_pages, attrs.recent_pages,
                    GROUP_REDUCE_IDS[attrs.group_reduce], attrs.sub_page_size, float(attrs.candidate_share))


def append_params(shapes: Mapping[str, Sequence[int]], pointers: Mapping[str, int | None],
                  dtype: str) -> QsaAppendParams:
    """Pack one ``qsa_append_kv`` call from shapes and addresses by name (``APPEND_POINTERS``;
    key ``[B, Hkv, S, D]``, key_cache ``[P, Hkv, ps, D]``, page_table ``[B, NP]``). Touches no memory."""
    B, Hkv, S, D = shapes["key"]
    P, _, ps, _ = shapes["key_cache"]
    p = QsaAppendParams()
    p.dims = QsaDims(B, Hkv, Hkv, S, D, P, ps, shapes["page_table"][1], shapes["key_min"][0])
    p.dtype = DTYPES[dtype]
    for name in APPEND_POINTERS:
        setattr(p, name, pointers.get(name))
    return p


def append_kv(lib: ctypes.CDLL, shapes: Mapping[str, Sequence[int]], pointers: Mapping[str, int | None],
              dtype: str, stream: int = 0) -> None:
    """Enqueue ``qsa_append_kv`` on ``stream`` (a cudaStream_t as int; 0 = legacy default).

    Stream-ordered and allocation-free: no synchronisation, no copy. Buffers must be
    contiguous and on the library's device. Raises KernelError when the call is
    refused; a bad page id or a full page table is reported later, through the
    int32 ``error_flags`` word (if given) once the stream has run (``check_flags``).
    """
    p = append_params(shapes, pointers, dtype)
    status = lib.qsa_append_kv(ctypes.byref(p), ctypes.c_void_p(stream or None))
    if status != QSA_OK:
        raise KernelError(status, "qsa_append_kv")
