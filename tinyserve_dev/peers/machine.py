"""The machine a benchmark runs on, for its table header: read bandwidth, load, commit, peak RSS.

``read_bandwidth`` is the yardstick of a step's memory traffic: numpy's max over a 1 GiB float32
array split across ``threads`` threads (numpy releases the GIL in the reduction and runs it on SIMD
lanes), best of ``repeats`` - a read-only stream, the access pattern of a decode step's weights. A
float64 ``np.sum`` (pairwise summation) was compute-bound: 8.4 GB/s a thread here against 14.3 for
the max, 15.5 vs 27.0 on 2 threads, and decode steps read "120-155%" of it. Peak RSS is the
kernel's high-water mark (``VmHWM``), which ``reset_peak_rss`` restarts where Linux allows it
(``/proc/self/clear_refs``), so one process can report the peak of each of its runs.
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import threading
import time
from pathlib import Path


def read_bandwidth(threads: int = 1, nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Bytes per second read by ``threads`` threads summing ``nbytes`` (best of ``repeats``)."""
    import numpy as np

    if threads < 1 or nbytes < 4 * threads or repeats < 1:
        raise ValueError(f"need threads >= 1, nbytes >= 4 x threads and repeats >= 1, got "
                         f"{threads}, {nbytes}, {repeats}")
    data = np.ones(nbytes // 4, np.float32)  # written once: every page is resident before timing
    parts = np.array_split(data, threads)
    best = float("inf")
    for _ in range(repeats):
        workers = [threading.Thread(target=np.max, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
    return data.nbytes / best


def load_average() -> str:
    """``os.getloadavg()`` as '1.23 / 0.45 / 0.10' (1 / 5 / 15 min), 'n/a' where unknown."""
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def git_commit(repo: str | Path) -> str:
    """Short commit of ``repo``'s HEAD, '+dirty' when tracked files differ from it; 'unknown' outside git."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine_line() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores"


def reset_peak_rss() -> bool:
    """Restart this process's peak-RSS mark; False where the kernel does not allow it
    (then ``peak_rss_bytes`` is the whole process's high-water mark)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set of this process since start or the last ``reset_peak_rss``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
