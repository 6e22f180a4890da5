"""Large buffers go back to the system when freed (issue #30: the export's memory bound).

glibc serves a request over its mmap threshold with its own mapping, returned on ``free``; below
it, from the heap, which keeps freed space. The threshold starts at 128 KiB but rises to the size
of each large block freed (up to 32 MiB), so after the first ORT session of an export is closed,
the next one's weights and float32 casts (blocks of 1-30 MiB) come from a heap that never shrinks:
Qwen2.5-0.5B fp16 peaked at 2.95x its weights that way, 2.06x with the threshold held at 1 MiB.
:func:`hold_mmap_threshold` holds it (``mallopt``, what ``MALLOC_MMAP_THRESHOLD_`` sets at start);
elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
THRESHOLD = 1 << 20


def hold_mmap_threshold(nbytes: int = THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` for this process; False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(nbytes)))
    except (OSError, AttributeError):
        return False


__all__ = ["hold_mmap_threshold"]
