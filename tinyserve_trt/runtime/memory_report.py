"""Where a run's memory went: weights, KV pages, and the rest (workspace), for the CLI footers.

Peak RSS is the process's high-water mark; the weights are the package's data file (ORT maps or
reads them once); the KV pages are the pool's pages at their peak use (the pool reserves more,
committed by the OS only as pages are written). What is left is the backend's workspace - for a
chunked prefill, about one chunk's activations whatever the context (the native CPU node holds no
attention scores; the op's ONNX function, where it runs, one chunk's [heads, chunk, context] scores).
"""

from __future__ import annotations

import resource

from tinyserve_trt.runtime.config import CacheConfig


def memory_line(engine) -> str:
    package, pool = engine.package, engine.pool
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    data = package.path / "model.onnx.data"
    weights = data.stat().st_size if data.is_file() else 0
    page = CacheConfig.page_bytes(pool.page_size, package.num_layers, package.num_kv_heads, package.head_dim,
                                  package.dtype)
    kv = page * engine.peak_pages_in_use
    rest = max(0, peak - weights - kv)
    gib = 2 ** 30
    return (f"memory: peak RSS {peak / gib:.2f} GiB = weights {weights / gib:.2f} + KV pages {kv / gib:.2f} "
            f"({engine.peak_pages_in_use} of {pool.num_pages} pages) + workspace {rest / gib:.2f}")
