"""Random but consistent op inputs: a shuffled page pool, page tables, exact min/max.

Shared by the op tests, the benchmarks and the GPU harness so every
implementation is checked on the same kind of data. Not used at serving time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyserve_trt.ops import schema
from tinyserve_trt.ops.fine_bounds import page_sub_bounds
from tinyserve_trt.ops.reference import page_min_max


@dataclass(frozen=True)
class CaseSpec:
    past_lens: tuple[int, ...]  # cached tokens per sequence (batch = len)
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    page_size: int = 16
    new_tokens: int = 1
    dtype: str = "float32"
    budget: int = 0  # same budget for every sequence
    spare_pages: int = 3  # pool pages no sequence uses
    extra_table_cols: int = 1  # padding columns past the longest sequence
    sub_page_size: int = 0  # > 0: also ``key_sub_bounds`` (two-level selection), from the keys the op attends

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if not self.past_lens or min(self.past_lens) < 0:
            raise ValueError("past_lens must be non-empty and >= 0")
        if self.sub_page_size and (self.sub_page_size < 0 or self.page_size % self.sub_page_size):
            raise ValueError(f"sub_page_size must divide page_size {self.page_size}, got {self.sub_page_size}")


def make_case(spec: CaseSpec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Inputs by schema name. Pages are placed at random pool slots; the slot
    tail of a partial page holds garbage (the op must ignore it)."""
    B, ps, D, Hkv = len(spec.past_lens), spec.page_size, spec.head_dim, spec.num_kv_heads
    dt = np.dtype(spec.dtype)
    pages_per_seq = [-(-p // ps) for p in spec.past_lens]
    P = sum(pages_per_seq) + spec.spare_pages
    NP = max(max(pages_per_seq), 0) + spec.extra_table_cols
    NP = max(NP, 1)
    key_cache = rng.standard_normal((P, Hkv, ps, D)).astype(dt)
    # keys with outlier channels and a sink-like first token, as real models have
    key_cache *= (1 + 4 * (rng.random(D) < 0.1)).astype(dt)
    value_cache = rng.standard_normal((P, Hkv, ps, D)).astype(dt)
    perm = rng.permutation(P)
    page_table = np.zeros((B, NP), dtype=np.int32)
    key_min = rng.standard_normal((P, Hkv, D)).astype(dt)  # unused pages: garbage metadata
    key_max = key_min.copy()
    r = ps // spec.sub_page_size if spec.sub_page_size else 1
    key_sub_bounds = rng.integers(0, 256, (P, Hkv, r, D)).astype(np.uint8)  # unused pages: garbage
    used = 0
    for b, n in enumerate(pages_per_seq):
        ids = perm[used:used + n]
        used += n
        page_table[b, :n] = ids
        page_table[b, n:] = rng.integers(0, P, NP - n)  # padding: valid ids, must be ignored
        for i, pid in enumerate(ids):
            valid = min(ps, spec.past_lens[b] - i * ps)
            for h in range(Hkv):
                key_min[pid, h], key_max[pid, h] = page_min_max(key_cache[pid, h], valid)
            if spec.sub_page_size:
                key_sub_bounds[pid] = page_sub_bounds(key_cache[pid], spec.sub_page_size, key_min[pid],
                                                      key_max[pid], valid)
    S = spec.new_tokens
    extra = dict(key_sub_bounds=key_sub_bounds) if spec.sub_page_size else {}
    return dict(
        query=rng.standard_normal((B, spec.num_heads, S, D)).astype(dt),
        key=rng.standard_normal((B, Hkv, S, D)).astype(dt),
        value=rng.standard_normal((B, Hkv, S, D)).astype(dt),
        key_cache=key_cache, value_cache=value_cache, key_min=key_min, key_max=key_max,
        page_table=page_table, past_lens=np.asarray(spec.past_lens, dtype=np.int32),
        token_budget=np.full(B, spec.budget, dtype=np.int32), **extra,
    )


def contiguous_kv(case: dict[str, np.ndarray], b: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequence ``b``'s cached K and V as ``[Hkv, past_len, D]`` (float64), from its pages."""
    past = int(case["past_lens"][b])
    ps = case["key_cache"].shape[2]
    n = -(-past // ps)
    ids = case["page_table"][b, :n]
    def cat(c):
        return np.concatenate([c[i] for i in ids], axis=1)[:, :past].astype(np.float64) if n else \
            np.zeros((c.shape[1], 0, c.shape[3]))
    return cat(case["key_cache"]), cat(case["value_cache"])


def page_valid_tokens(case: dict[str, np.ndarray]) -> np.ndarray:
    """``[P]`` valid tokens of each hot pool page: used pages from ``past_lens``, others full."""
    ps = case["key_cache"].shape[2]
    valid = np.full(case["key_cache"].shape[0], ps, np.int64)
    for b, past in enumerate(case["past_lens"]):
        n = -(-int(past) // ps)
        for i, pid in enumerate(case["page_table"][b, :n]):
            valid[pid] = min(ps, int(past) - i * ps)
    return valid


def make_mixed_case(spec: CaseSpec, rng: np.random.Generator, cold_fraction: float = 0.5,
                    k_granularity: str = "channel", v_granularity: str = "token", cold_format: str = "int8",
                    group_size: int = 0) -> dict[str, np.ndarray]:
    """:func:`make_case`, then a random subset of pool pages moved to the cold tier
    (``cold_format`` int8, or int4 packed with float16 scales per ``group_size`` channels).

    Hot pages keep ids ``[0, P)``, cold ones get ``[P, P + Pcold)`` (both tiers
    hold at least one page). Cold pages are quantized with ``ops.cold_codec``
    from their valid tokens. INT8: their ``key_min``/``key_max`` are recomputed
    from the DEQUANTIZED keys (metadata must bound what the op attends, and
    rounding can move a key up to scale/2 past the original extremes), and their
    ``key_sub_bounds`` (``spec.sub_page_size`` set) encode the dequantized keys. INT4
    keys are quantized on the page bounds - two-level: on the sub-page bounds the hot
    keys' codes decode to - and the metadata stays (format 3, ``ops/cold_codec.py``).
    """
    from tinyserve_trt.ops.cold_codec import ColdCodec  # noqa: PLC0415 (cases only)

    codec = ColdCodec(cold_format, k_granularity, v_granularity, group_size)
    case = make_case(spec, rng)
    valid = page_valid_tokens(case)
    Ptot = case["key_cache"].shape[0]
    if Ptot < 2:
        raise ValueError("a mixed case needs at least 2 pool pages (one per tier)")
    n_cold = int(np.clip(round(cold_fraction * Ptot), 1, Ptot - 1))
    order = rng.permutation(Ptot)
    cold_old, hot_old = np.sort(order[:n_cold]), np.sort(order[n_cold:])
    new_id = np.empty(Ptot, np.int64)
    new_id[hot_old] = np.arange(hot_old.size)
    new_id[cold_old] = hot_old.size + np.arange(n_cold)
    old_of_new = np.concatenate([hot_old, cold_old])

    dt = case["key_cache"].dtype
    key_min, key_max = case["key_min"][old_of_new].copy(), case["key_max"][old_of_new].copy()
    sub = case["key_sub_bounds"][old_of_new].copy() if spec.sub_page_size else None
    kq, vq, ks, vs = [], [], [], []
    for i, old in enumerate(cold_old):
        new = hot_old.size + i
        codes = sub[new] if sub is not None and codec.keys_on_bounds else None  # INT4: the hot keys' codes
        qk, sk = codec.quantize(case["key_cache"][old], "k", int(valid[old]), bounds=(key_min[new], key_max[new]),
                                sub_codes=codes)
        qv, sv = codec.quantize(case["value_cache"][old], "v", int(valid[old]))
        kq.append(qk), ks.append(sk), vq.append(qv), vs.append(sv)
        if codec.keys_on_bounds:  # INT4: inside the page's (sub-page's) own bounds: its metadata stays
            continue
        deq = codec.dequantize(qk, sk, dt)
        for h in range(deq.shape[0]):
            key_min[new, h], key_max[new, h] = page_min_max(deq[h], int(valid[old]))
        if sub is not None:
            sub[new] = page_sub_bounds(deq, spec.sub_page_size, key_min[new], key_max[new], int(valid[old]))
    case.update(
        key_cache=case["key_cache"][hot_old], value_cache=case["value_cache"][hot_old],
        key_min=key_min, key_max=key_max, page_table=new_id[case["page_table"]].astype(np.int32),
        key_cache_int8=np.stack(kq), value_cache_int8=np.stack(vq),
        key_scale=np.stack(ks), value_scale=np.stack(vs),
    )
    if sub is not None:
        case["key_sub_bounds"] = sub
    return case


def dequantized_case(case: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The all-hot equivalent of a mixed case: cold pages dequantized into the float pools,
    same page ids, no cold inputs. The op must give the same result on both."""
    from tinyserve_trt.ops.cold_codec import ColdCodec  # noqa: PLC0415

    dt = case["key_cache"].dtype
    codec = ColdCodec("int4" if case["key_cache_int8"].dtype == np.uint8 else "int8")
    out = {k: v for k, v in case.items() if k not in ("key_cache_int8", "value_cache_int8",
                                                       "key_scale", "value_scale")}
    P = case["key_cache"].shape[0]
    sub = case.get("key_sub_bounds")
    cold_k = codec.dequantize_keys(case["key_cache_int8"], case["key_scale"], case["key_min"][P:],
                                   case["key_max"][P:], dt, sub_codes=None if sub is None else sub[P:])
    cold_v = codec.dequantize(case["value_cache_int8"], case["value_scale"], dt)
    out["key_cache"] = np.concatenate([case["key_cache"], cold_k])
    out["value_cache"] = np.concatenate([case["value_cache"], cold_v])
    return out


def dequantized_float32_case(case: dict) -> dict:
    """The all-hot equivalent of a hot + INT8 case, holding exactly what the kernels read:
    float inputs widened to float32 (exact from float16), cold pages dequantized by
    ``dequantized_case`` in float32, so int8 * scale is not rounded to float16
    on top (that rounding alone moves a float16 D=128 output by ~1e-3)."""
    wide = {n: a.astype(np.float32) if a.dtype.kind == "f" and n not in schema.COLD_INPUTS else a
            for n, a in case.items()}
    return dequantized_case(wide)
