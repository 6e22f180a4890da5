"""The ``engine`` ObservationSource: a tinyserve package run by the runtime (ONNX Runtime backend).

For a user who has only what ``tinyserve-export model.onnx`` wrote (no Hugging
Face directory). Every prompt goes through the package's own engine, one
request at a time, teacher-forced:

- the first ``T - decode_steps`` tokens are prefilled (chunked, dense, as
  serving does), the rest are fed as decode steps at the package's token
  budget, each step's token being the prompt's next one;
- keys / values are read from the page pool once the whole prompt is cached:
  what the op attends (after rotary, in the package's dtype, as float32);
- selections are the op's own ``selected_pages`` output of every layer at the
  decode steps (dense layers report every page) - not a replay;
- ``next_token_logits`` prefills all but the last token, passes the cached
  pages through the KVTransform and writes them back into the pool (the pool
  recomputes key_min/key_max and sub-page bounds), then runs the last token as
  a decode step: the logits the runtime would give over that cache.

The engine runs with every page hot (``kv_tiers=False``) and no prefix sharing,
so a cold-tier package is observed at full precision. Does not modify the package.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from tinyserve_trt.calibration.source import KVTransform, Observation, ObservationSource, register_source
from tinyserve_trt.ops import schema


class EngineSource(ObservationSource):
    """package_dir: a directory written by ``tinyserve-export``.
    page_size: must be the package's (None: take it) - fixed at export.
    token_budget: decode budget of the observed steps (None: the package's default).
    decode_steps: trailing prompt positions run as decode steps."""

    def __init__(self, package_dir: str, page_size: int | None = None, token_budget: int | None = None,
                 decode_steps: int = 8, threads: int | None = None, backend: str = "ort"):
        from tinyserve_trt.runtime.config import EngineConfig  # noqa: PLC0415
        from tinyserve_trt.runtime.engine import Engine  # noqa: PLC0415
        from tinyserve_trt.runtime.model_package import ModelPackage  # noqa: PLC0415
        from tinyserve_trt.runtime.sampling import SampleOutput, SamplingParams  # noqa: PLC0415

        package = ModelPackage.load(package_dir)
        if page_size is not None and page_size != package.page_size:
            raise ValueError(f"the package's page size is {package.page_size} (fixed at export), not {page_size}")
        if not all("selected_pages" in layer for layer in package.layers):
            raise ValueError("the package's op does not output selected_pages; re-export it with this tinyserve")
        if not isinstance(decode_steps, int) or decode_steps < 1:
            raise ValueError(f"decode_steps must be a positive int, got {decode_steps!r}")
        self.package = package
        self.num_layers, self.num_kv_heads, self.head_dim = package.num_layers, package.num_kv_heads, package.head_dim
        self.page_size = package.page_size
        self.max_context = package.max_context
        self.token_budget = package.token_budget if token_budget is None else token_budget
        self.decode_steps = decode_steps
        # sparse_min_ratio 0: observe the op's own selection at every context, never the runtime's dense rule
        self.engine = Engine(package, EngineConfig(backend=backend, token_budget=self.token_budget, max_batch=1,
                                                   prefix_sharing=False, kv_tiers=False, threads=threads,
                                                   sparse_min_ratio=0))
        self._SampleOutput, self._SamplingParams = SampleOutput, SamplingParams
        self._ids = itertools.count()

    def op_settings(self) -> dict:
        """The package's op settings (its selection rule: GQA group reduction, candidate share); with a
        cold tier also its codec (format, group size) and the two-level layout (sub-page size, dense
        layers), so held-out evaluation quantizes as its pool."""
        spec = self.package.spec
        out = dict(page_size=self.page_size, token_budget=self.token_budget, sink_pages=spec.sink_pages,
                   recent_pages=spec.recent_pages, kv_dtype=self.package.dtype,
                   sub_page_size=spec.sub_page_size, dense_layers=spec.dense_layers,
                   group_reduce=spec.group_reduce, candidate_share=spec.candidate_share
                   if spec.candidate_share is not None else schema.attribute("candidate_share").default)
        if spec.cold_tier is not None:
            out.update(cold_format=spec.cold_tier.cold_format, group_size=spec.cold_tier.group_size)
        return out

    def tokenize(self, text: str) -> list[int]:
        return self.package.encode(text)

    def observe(self, token_ids: Sequence[int]) -> Observation:
        T = len(token_ids)
        start = max(1, T - self.decode_steps)
        selected, _, (k, v) = self._forced(token_ids, start)
        n = -(-(T - 1) // self.page_size)  # pages of the longest decode step's past
        sel = np.zeros((len(selected), self.num_layers, self.num_kv_heads, n), bool)
        for i, step in enumerate(selected):
            w = min(n, step.shape[-1])
            sel[i, :, :, :w] = step[:, :, :w]
        return Observation(keys=k, values=v, selected_pages=sel)

    def next_token_logits(self, token_ids: Sequence[int], transform: KVTransform | None = None) -> np.ndarray:
        if len(token_ids) < 2:
            raise ValueError("next_token_logits needs at least 2 tokens (a cache and a decode step)")
        _, logits, _ = self._forced(token_ids, len(token_ids) - 1, transform)
        return logits.astype(np.float64)

    def next_token_logits_many(self, token_ids: Sequence[int],
                               transforms: Sequence[KVTransform | None]) -> list[np.ndarray]:
        """One prefill of all but the last token, then the last token's decode step once per
        transform (:meth:`tail_logits_many` with one position)."""
        if len(token_ids) < 2:
            raise ValueError("next_token_logits needs at least 2 tokens (a cache and a decode step)")
        return [rows[0] for rows in self.tail_logits_many(token_ids, transforms, 1)]

    def tail_logits_many(self, token_ids: Sequence[int], transforms: Sequence[KVTransform | None],
                         positions: int) -> list[np.ndarray]:
        """One prefill of the first ``T - positions`` tokens, the last ``positions`` as teacher-forced
        decode steps (their batches kept); then per transform the first ``T - positions`` cached
        tokens are restored from a snapshot, transformed, and the kept steps rerun in order (each
        rewrites its own token's slot first, so the later tokens see the transformed cache)."""
        token_ids = [int(t) for t in token_ids]
        T = len(token_ids)
        if not isinstance(positions, int) or not 1 <= positions <= T - 1:
            raise ValueError(f"positions must be in [1, {T - 1}], got {positions!r}")
        start = T - positions
        engine = self.engine
        sched, backend = engine.scheduler, engine.backend
        rid = f"calibrate-{next(self._ids)}"
        seq = engine.add_request(rid, token_ids[:start], self._SamplingParams(temperature=0, max_tokens=positions + 2,
                                                                            ignore_eos=True))
        steps, snapshot = [], None
        try:
            while len(steps) < positions:
                batch = sched.schedule()
                past, new = int(batch.past_lens[0]), int(batch.num_new_tokens[0])
                if past >= start and new == 1:  # a tail step: keep its batch (fresh arrays per step)
                    if snapshot is None:
                        snapshot = self._read(seq.pages, start)
                    steps.append(batch)  # max_tokens leaves it unfinished: its pages stay
                backend.run(batch)
                nxt = past + new
                token = token_ids[nxt] if nxt < T else 0
                sched.postprocess(batch, self._SampleOutput(np.array([token], np.int64)))
            out = []
            for transform in transforms:
                self._rewrite(seq.pages, start, transform, snapshot)
                out.append(np.stack([backend.run(b).logits[0].astype(np.float64) for b in steps]))
            return out
        finally:
            sched.cancel(rid)

    # ---- one teacher-forced request ------------------------------------------------
    def _forced(self, token_ids: Sequence[int], decode_from: int, transform: KVTransform | None = None):
        """Prefill ``token_ids[:decode_from]``, then decode the rest one token a step.

        Returns (per decode step ``[L, Hkv, pages]`` selections, ``[vocab]`` logits after the
        last token, ``(keys, values)`` ``[L, Hkv, T, D]`` float32 from the pool). ``transform``
        rewrites the pool's pages of ``token_ids[:decode_from]`` before the first decode step."""
        token_ids = [int(t) for t in token_ids]
        T = len(token_ids)
        if not 1 <= decode_from < T:
            raise ValueError(f"decode_from must be in [1, {T}), got {decode_from}")
        engine = self.engine
        sched, backend = engine.scheduler, engine.backend
        rid = f"calibrate-{next(self._ids)}"
        params = self._SamplingParams(temperature=0, max_tokens=T - decode_from + 1, ignore_eos=True)
        seq = engine.add_request(rid, token_ids[:decode_from], params)
        selected, result = [], None
        try:
            while result is None:
                if transform is not None and seq.num_cached_tokens == decode_from:
                    self._rewrite(seq.pages, decode_from, transform)
                    transform = None
                batch = sched.schedule()
                out = backend.run(batch)
                past, new = int(batch.past_lens[0]), int(batch.num_new_tokens[0])
                if new == 1 and past >= decode_from:
                    if out.selected_pages is None:
                        raise RuntimeError("the backend did not report selected_pages")
                    selected.append(np.stack([np.asarray(s[0], bool) for s in out.selected_pages]))
                if past + new == T:  # whole prompt cached: read it before the request can finish
                    result = out.logits[0].copy(), self._read(seq.pages, T)
                nxt = past + new
                token = token_ids[nxt] if nxt < T else int(np.argmax(out.logits[0]))  # read where sampled
                sched.postprocess(batch, self._SampleOutput(np.array([token], np.int64)))
        finally:
            sched.cancel(rid)
        return selected, result[0], result[1]

    def _read(self, pages: list[int], T: int) -> tuple[np.ndarray, np.ndarray]:
        """``[L, Hkv, T, D]`` float32 keys and values of the first ``T`` tokens of ``pages``."""
        pool = self.engine.pool
        phys = pool.physical_table(np.asarray([pages[: -(-T // self.page_size)]]))[0]

        def tokens(pool_array):  # [P, Hkv, ps, D] -> [Hkv, T, D]
            a = pool_array[phys]
            return np.swapaxes(a, 0, 1).reshape(self.num_kv_heads, -1, self.head_dim)[:, :T].astype(np.float32)

        return (np.stack([tokens(pool.k_pages(i)) for i in range(self.num_layers)]),
                np.stack([tokens(pool.v_pages(i)) for i in range(self.num_layers)]))

    def _rewrite(self, pages: list[int], T: int, transform: KVTransform | None,
                 snapshot: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Pass the first ``T`` cached tokens of every layer (or ``snapshot``, a :meth:`_read`) through
        ``transform`` (None: as they are) and write them back."""
        keys, values = self._read(pages, T) if snapshot is None else snapshot
        ps = self.page_size
        pos = np.arange(T)
        slots = np.asarray(pages, np.int64)[pos // ps] * ps + pos % ps
        for layer in range(self.num_layers):
            k, v = (keys[layer], values[layer]) if transform is None else transform(layer, keys[layer], values[layer])
            self.engine.pool.write_tokens(layer, slots, np.ascontiguousarray(np.swapaxes(k, 0, 1)),
                                          np.ascontiguousarray(np.swapaxes(v, 0, 1)))

    def close(self) -> None:
        self.engine.close()


register_source("engine")(EngineSource)
