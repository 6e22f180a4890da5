"""A fake model for runtime tests: deterministic K/V, random next tokens.

Keys are a pure function of (token id, position), so any page a sequence holds
must contain exactly ``fake_key(tokens[i], i)`` at slot i; that makes prefix
reuse and copy-on-write checkable without a real model.
"""

from __future__ import annotations

import numpy as np

from tinyserve_trt.runtime.pages import PagePool
from tinyserve_trt.runtime.sampling import SampleOutput
from tinyserve_trt.runtime.scheduler import Scheduler


def fake_key(token_ids: np.ndarray, positions: np.ndarray, layer: int, heads: int, dim: int) -> np.ndarray:
    """``[..., heads, dim]`` key of each (token, position); small exact floats."""
    base = (np.asarray(token_ids, np.int64) * 7 + np.asarray(positions, np.int64) * 3 + layer) % 1021
    grid = np.arange(heads * dim).reshape(heads, dim)
    return ((base[..., None, None] + grid) % 97 - 48).astype(np.float32)


def run_model(pool: PagePool, batch) -> None:
    """Write every layer's new K/V of ``batch`` as a backend would ([B, Hkv, T, D])."""
    if len(batch) == 0:
        return
    for layer in range(pool.num_layers):
        k = fake_key(batch.input_ids, batch.positions, layer, pool.num_kv_heads, pool.head_dim)
        k = np.swapaxes(k, 1, 2)  # [B, T, Hkv, D] -> [B, Hkv, T, D]
        pool.write_batch(layer, batch.slot_mapping, k, -k)


def step(sched: Scheduler, rng: np.random.Generator, vocab: int = 8) -> list:
    """One engine step with random sampled tokens; returns the finished sequences."""
    batch = sched.schedule()
    run_model(sched.pool, batch)
    tokens = rng.integers(0, vocab, size=len(batch))
    return sched.postprocess(batch, SampleOutput(tokens))


def check_kv_contents(sched: Scheduler) -> None:
    """Every cached token of every running sequence holds its fake key in its page."""
    pool, ps = sched.pool, sched.pool.page_size
    for seq in sched.running:
        n = seq.num_cached_tokens
        if n == 0:
            continue
        pos = np.arange(n)
        pages = np.asarray(seq.pages)[pos // ps]
        want = fake_key(np.asarray(seq.token_ids[:n]), pos, 0, pool.num_kv_heads, pool.head_dim)
        got = pool.k_pages(0)[pages, :, pos % ps, :]
        np.testing.assert_array_equal(got, want, err_msg=f"K/V of {seq!r}")


def check_minmax(pool: PagePool) -> None:
    """key_min/key_max of every in-use page equal a brute-force recomputation."""
    for layer in range(pool.num_layers):
        for page in pool.in_use_pages():
            n = pool.num_valid(layer)[page]
            if n == 0:
                continue
            keys = pool.k_pages(layer)[page, :, :n, :]
            np.testing.assert_array_equal(pool.key_min(layer)[page], keys.min(axis=1))
            np.testing.assert_array_equal(pool.key_max(layer)[page], keys.max(axis=1))
