"""TensorRT optimization profiles of a package: the (min, opt, max) shape of every
dynamic input, derived from the manifest. Shared by the exporter (engine builds)
and the runtime (ORT's TensorRT EP), so it lives below both."""

from __future__ import annotations

from .cold_tier import tier_codec

BATCH = (1, 8, 64)  # rows per step: (min, opt, max) of the engine's profile
NEW_TOKENS = (1, 1, 512)  # new tokens per row: decode-tuned, prefill chunks up to 512


def engine_profiles(manifest: dict, max_context: int) -> tuple[dict[str, tuple], dict]:
    """The (min, opt, max) shape of every dynamic input of the rewritten model, and the
    limits ``manifest["engine"]`` records for the runtime.

    TensorRT needs a range for every dynamic input, and inputs sharing an ONNX dim
    name (``batch``, ``num_pages``, ...) must get overlapping ranges. Page tables
    cover ``max_context``; the hot page pools (and key_min/key_max) hold up to twice
    what ``BATCH[2]`` sequences of ``max_context`` need - room for prefix-cached
    pages - and a cold tier as many cold pages again (its metadata rows are hot + cold), each
    layer's in its own codec's shapes (``cold_tier.tier_codec``: INT8, or packed INT4).
    A two-level package's ``key_sub_bounds`` (sparse layers only) has key_min's rows.
    """
    io, ps = manifest["io"], manifest["page_size"]
    hkv, d = manifest["num_kv_heads"], manifest["head_dim"]
    max_pages = -(-max_context // ps)
    batch, chunk = BATCH, NEW_TOKENS
    pool = (1, batch[1] * max_pages, 2 * batch[2] * max_pages)
    cold = manifest.get("cold_tier")
    sub = manifest.get("sub_page_size") or 0
    rows = tuple(2 * n for n in pool) if cold else pool  # key_min/key_max: P (+ Pcold) rows
    inputs = io["inputs"]
    profiles = {inputs["input_ids"]: tuple((b, t) for b, t in zip(batch, chunk)),
                inputs["page_table"]: ((1, 1), (batch[1], max_pages // 2 or 1), (batch[2], max_pages))}
    if "position_ids" in inputs:
        profiles[inputs["position_ids"]] = profiles[inputs["input_ids"]]
    for role in ("past_lens", "token_budget", "logits_index"):
        if role in inputs:
            profiles[inputs[role]] = tuple((b,) for b in batch)
    for i, names in enumerate(io["layers"]):
        for role in ("key_cache", "value_cache"):
            profiles[names[role]] = tuple((n, hkv, ps, d) for n in pool)
        for role in ("key_min", "key_max"):
            profiles[names[role]] = tuple((n, hkv, d) for n in rows)
        if sub and "key_sub_bounds" in names:
            profiles[names["key_sub_bounds"]] = tuple((n, hkv, ps // sub, d) for n in rows)
        if cold:  # the layer's own format (an int4 package's int8_layers are INT8)
            codec = tier_codec(cold, i)
            for role in ("key_cache_int8", "value_cache_int8"):
                profiles[names[role]] = tuple((n, *codec.pool_shape(hkv, ps, d)) for n in pool)
            for role, which in (("key_scale", "k"), ("value_scale", "v")):
                profiles[names[role]] = tuple((n, *codec.scale_shape(which, hkv, ps, d)) for n in pool)
    limits = dict(max_batch=batch[2], max_new_tokens=chunk[2], max_pages=max_pages, max_pool_pages=pool[2],
                  max_cold_pages=pool[2] if cold else 0)
    return profiles, limits
