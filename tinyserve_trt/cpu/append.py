"""The native page key bounds and sub-page codes, in C++: a decode step's appends and a prefill's pages.

``csrc/qsa_append.cpp`` (in ``libtinyserve_cpu.so``, built by ``native.py``) does what
``runtime/append_bounds.py::append_bounds_numpy`` does, bit for bit, in one pass over the
touched pages instead of ~500 small numpy reductions per step; and :func:`page_bounds` what
``host_storage``'s ``_refresh_minmax`` does for every layer of the pages a prefill chunk wrote
(~0.1 s of numpy per 512-token SmolLM2 chunk: a copy of the pages, masked reductions, the
sub-page encoder's float64 passes). float32 pools only:
:func:`qualifies` says whether a call's arrays can take this path. Loaded with ctypes on first
use; imports numpy, so ``tinyserve_trt.cpu`` does not import this module itself.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from . import native

SYMBOL = "tinyserve_append_bounds"
PAGES_SYMBOL = "tinyserve_page_bounds"
_ERRORS = {
    1: "a page id is outside the hot pool",
    2: "an offset is outside [0, page_size)",
    3: "two appended tokens share a page (one append per page per call)",
    4: "sub-page bounds fall outside the page's key_min/key_max",  # fine_bounds.encode's message
}
_FUNCTIONS: dict = {}  # symbol -> the loaded function, once
_BUILD: dict = {}  # "reason": native.available()'s answer, once (a failed build is not retried every step)


def available() -> str | None:
    """None when the native function can be used, else the one-line reason it cannot
    (``TINYSERVE_NATIVE=0``, no compiler, ...). The switch is read on every call (cheap); the build
    is tried once per process."""
    if os.environ.get(native.ENV_DISABLE, "1").strip() == "0":
        return native.available()
    if "reason" not in _BUILD:
        reason = native.available()
        if reason is None:
            try:
                _function(SYMBOL)
                _function(PAGES_SYMBOL)
            except (OSError, AttributeError) as e:  # a library that loads for ORT but not here: say why, once
                reason = f"{native.LIBRARY_NAME} cannot be loaded for the page bounds ({' '.join(str(e).split())[:200]})"
        _BUILD["reason"] = reason
    return _BUILD["reason"]


def _function(symbol: str = SYMBOL):
    if symbol not in _FUNCTIONS:
        fn = getattr(ctypes.CDLL(str(native.library_path())), symbol)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * (7 if symbol == SYMBOL else 6) + [ctypes.c_int64] * 8
        _FUNCTIONS[symbol] = fn
    return _FUNCTIONS[symbol]


def qualifies(keys: np.ndarray, key_min: np.ndarray, key_max: np.ndarray, sub: np.ndarray | None,
              k: np.ndarray) -> bool:
    """Whether the arrays fit the native function: float32 pool, bounds and keys, uint8 codes,
    the pool, bounds and codes C-contiguous (they are written in place)."""
    f32 = np.dtype(np.float32)
    if not all(a.dtype == f32 for a in (keys, key_min, key_max, k)):
        return False
    if sub is not None and sub.dtype != np.uint8:
        return False
    return all(a.flags.c_contiguous for a in (keys, key_min, key_max) + ((sub,) if sub is not None else ()))


def _pool_dims(keys, key_min, key_max, sub) -> tuple[int, ...]:
    """(L, N, Hkv, ps, D, Nm, r) of a pool, its bounds and codes (r 0 without codes); ValueError
    (one line) when they do not fit together."""
    if keys.ndim != 5:
        raise ValueError(f"keys must be [L, N, Hkv, ps, D], got shape {keys.shape}")
    L, N, H, ps, D = keys.shape
    if key_min.ndim != 4 or key_min.shape != key_max.shape or key_min.shape[0] != L \
            or key_min.shape[2:] != (H, D) or key_min.shape[1] < N:
        raise ValueError(f"key_min/key_max must be [{L}, >={N}, {H}, {D}], got {key_min.shape} and {key_max.shape}")
    Nm = key_min.shape[1]
    r = 0
    if sub is not None:
        r = sub.shape[3] if sub.ndim == 5 else 0
        if sub.shape != (L, Nm, H, r, D) or r < 1 or ps % r:
            raise ValueError(f"sub must be [{L}, {Nm}, {H}, r, {D}] with r dividing {ps}, got {sub.shape}")
    return L, N, H, ps, D, Nm, r


def append_bounds(keys: np.ndarray, key_min: np.ndarray, key_max: np.ndarray, sub: np.ndarray | None,
                  page: np.ndarray, off: np.ndarray, k: np.ndarray) -> None:
    """``runtime.append_bounds.append_bounds_numpy`` natively; same arguments and shapes:
    ``keys [L, N, Hkv, ps, D]``, ``key_min/key_max [L, Nm, Hkv, D]``, ``sub [L, Nm, Hkv, r, D]`` or
    None, ``page/off [T]``, ``k [L, T, Hkv, D]``. Raises ValueError (one line) on arrays that do not
    qualify or do not fit together, NativeUnavailable when the library cannot be loaded."""
    if not qualifies(keys, key_min, key_max, sub, k):
        raise ValueError("native append_bounds needs float32 C-contiguous keys/key_min/key_max/k and uint8 codes")
    L, N, H, ps, D, Nm, r = _pool_dims(keys, key_min, key_max, sub)
    page = np.ascontiguousarray(page, np.int64)
    off = np.ascontiguousarray(off, np.int64)
    if page.ndim != 1 or off.shape != page.shape:
        raise ValueError(f"page and off must be [T] each, got {page.shape} and {off.shape}")
    T = page.shape[0]
    if k.shape != (L, T, H, D):
        raise ValueError(f"k must be [{L}, {T}, {H}, {D}], got {k.shape}")
    k = np.ascontiguousarray(k)
    status = _function()(keys.ctypes.data, key_min.ctypes.data, key_max.ctypes.data,
                         None if sub is None else sub.ctypes.data, page.ctypes.data, off.ctypes.data,
                         k.ctypes.data, L, N, Nm, H, ps, D, T, r)
    if status:
        raise ValueError(_ERRORS.get(status, f"native append_bounds failed with status {status}"))


def page_bounds(keys: np.ndarray, key_min: np.ndarray, key_max: np.ndarray, sub: np.ndarray | None,
                pages: np.ndarray, valid: np.ndarray) -> None:
    """key_min/key_max (and sub-page codes) of physical ``pages [U]`` in every layer, recomputed from
    ``keys [L, N, Hkv, ps, D]`` over ``valid [L, U]`` tokens each: ``host_storage``'s
    ``_refresh_minmax(slice(None), ...)`` natively, bit for bit. Shapes as :func:`append_bounds`;
    ValueError (one line) on arrays that do not qualify or fit, NativeUnavailable without the library."""
    if not qualifies(keys, key_min, key_max, sub, keys[:0]):
        raise ValueError("native page_bounds needs float32 C-contiguous keys/key_min/key_max and uint8 codes")
    L, N, H, ps, D, Nm, r = _pool_dims(keys, key_min, key_max, sub)
    pages = np.ascontiguousarray(pages, np.int64)
    if pages.ndim != 1:
        raise ValueError(f"pages must be [U], got shape {pages.shape}")
    valid = np.asarray(valid)
    if valid.shape != (L, pages.shape[0]):
        raise ValueError(f"valid must be [{L}, {pages.shape[0]}], got shape {valid.shape}")
    valid = np.ascontiguousarray(valid, np.int64)
    status = _function(PAGES_SYMBOL)(keys.ctypes.data, key_min.ctypes.data, key_max.ctypes.data,
                                     None if sub is None else sub.ctypes.data, pages.ctypes.data, valid.ctypes.data,
                                     L, N, Nm, H, ps, D, pages.shape[0], r)
    if status:
        raise ValueError({1: _ERRORS[1], 2: "a valid count is outside [0, page_size]"}.get(
            status, _ERRORS.get(status, f"native page_bounds failed with status {status}")))
