"""Page key bounds after a decode step's appends, updated instead of recomputed.

A decode step appends one token to each touched page. Recomputing a page's
key min/max and sub-page codes (``ops.fine_bounds``) reads the whole page in
every layer; for an append the result follows from the stored bounds and the
new token alone, bit for bit:

* min/max: ``min(old, k)`` / ``max(old, k)`` (the page's first token: ``k``) -
  a min over the same float values, whatever the order;
* sub-page codes are elementwise in (sub-page, channel) given the sub-page's
  min/max and the page's: only the appended token's sub-page changes in every
  channel, and every sub-page of the channels whose page min or max moved. Only
  those are re-encoded (``fine_bounds.encode``) from the stored keys, over the
  page's valid tokens, as ``fine_bounds.pages_sub_bounds`` would.

Over a host storage's arrays (``host_storage.HostKVStorage``); the caller has
written the tokens and checked that each is a page's only token this step, at
offset = the page's valid count before it in every layer. :func:`append_bounds`
runs the native function (``cpu/append.py``, equal bit for bit) when the library
is available and the arrays are float32; else :func:`append_bounds_numpy`, the
reference (~8 ms a step at batch 8 on a 30-layer model: ~500 small reductions).
"""

from __future__ import annotations

import numpy as np

from tinyserve_trt.cpu import append as native_append
from tinyserve_trt.ops.fine_bounds import encode


def append_bounds(keys: np.ndarray, key_min: np.ndarray, key_max: np.ndarray, sub: np.ndarray | None,
                  page: np.ndarray, off: np.ndarray, k: np.ndarray) -> None:
    """:func:`append_bounds_numpy`, natively when it can (float32 arrays, library available)."""
    if native_append.qualifies(keys, key_min, key_max, sub, k) and native_append.available() is None:
        native_append.append_bounds(keys, key_min, key_max, sub, page, off, k)
    else:
        append_bounds_numpy(keys, key_min, key_max, sub, page, off, k)


def append_bounds_numpy(keys: np.ndarray, key_min: np.ndarray, key_max: np.ndarray, sub: np.ndarray | None,
                        page: np.ndarray, off: np.ndarray, k: np.ndarray) -> None:
    """Update bounds in place after appending one token per page in every layer.

    keys:             ``[L, N, Hkv, ps, D]`` the pool, tokens already written.
    key_min, key_max: ``[L, N, Hkv, D]``; sub: ``[L, N, Hkv, r, D]`` uint8 codes, or None.
    page, off:        ``[T]`` physical page and offset of each appended token (distinct pages;
                      ``off`` is the page's valid count before the write).
    k:                ``[L, T, Hkv, D]`` the appended keys.
    """
    fresh = (off == 0)[None, :, None, None]  # a page's first token: its bounds are that token
    old_min, old_max = key_min[:, page], key_max[:, page]
    new_min = np.where(fresh, k, np.minimum(old_min, k))
    new_max = np.where(fresh, k, np.maximum(old_max, k))
    key_min[:, page], key_max[:, page] = new_min, new_max
    if sub is None:
        return
    ps, r = keys.shape[3], sub.shape[3]
    sp = ps // r
    valid = off + 1  # [T]
    # every sub-page of the channels whose page bounds moved (all of a fresh page)
    moved = (new_min != old_min) | (new_max != old_max) | fresh
    li, ti, hi, di = np.nonzero(moved)
    if li.size:
        # only the sub-pages that hold a token (the rest code 0, the page bounds): a young page
        # moves many channels but has few sub-pages, an old one the reverse
        w = -(-int(valid[ti].max()) // sp)
        rows = keys[li, page[ti], hi, : w * sp, di].astype(np.float32)  # [n, w * sp]
        written = np.arange(w * sp) < valid[ti][:, None]
        lo = np.where(written, rows, np.inf).reshape(-1, w, sp).min(axis=2)
        up = np.where(written, rows, -np.inf).reshape(-1, w, sp).max(axis=2)
        pmin, pmax = new_min[li, ti, hi, di][:, None], new_max[li, ti, hi, di][:, None]
        empty = ~written.reshape(-1, w, sp).any(axis=2)
        lo = np.where(empty, pmin.astype(np.float32), lo)
        up = np.where(empty, pmax.astype(np.float32), up)
        codes = np.zeros((li.size, r), sub.dtype)
        codes[:, :w] = encode(lo[..., None], up[..., None], pmin, pmax)[..., 0]
        sub[li, page[ti], hi, :, di] = codes
    # the appended token's sub-page, every channel
    j = off // sp
    tok = j[:, None] * sp + np.arange(sp)  # [T, sp]
    rows = keys[:, page[:, None], :, tok, :].astype(np.float32)  # [T, sp, L, Hkv, D]
    written = (tok < valid[:, None])[:, :, None, None, None]
    lo = np.where(written, rows, np.inf).min(axis=1)  # [T, L, Hkv, D]: never empty
    up = np.where(written, rows, -np.inf).max(axis=1)
    pmin, pmax = np.swapaxes(new_min, 0, 1), np.swapaxes(new_max, 0, 1)
    sub[:, page, :, j, :] = encode(lo[..., None, :], up[..., None, :], pmin, pmax)[..., 0, :]
