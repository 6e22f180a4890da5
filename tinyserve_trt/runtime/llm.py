"""LLM: the offline Python API - load a package, generate for a batch, stream one request.

    from tinyserve_trt import LLM, SamplingParams
    llm = LLM("smollm2-pkg", token_budget=1024)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(out[0].outputs[0].text, out[0].stats.ttft, llm.stats())
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence as Seq
from pathlib import Path

from tinyserve_trt.runtime.config import EngineConfig
from tinyserve_trt.runtime.engine import Engine
from tinyserve_trt.runtime.generation_defaults import default_params
from tinyserve_trt.runtime.limits import check_against_package, check_engine_budget
from tinyserve_trt.runtime.model_package import ModelPackage
from tinyserve_trt.runtime.outputs import RequestOutput, RequestTracker
from tinyserve_trt.runtime.sampling import SamplingParams


def normalize_prompts(package: ModelPackage, prompts, prompt_token_ids) -> list[tuple[str | None, list[int]]]:
    """(text, ids) per prompt from either a str / list of str or ids / list of id lists."""
    if (prompts is None) == (prompt_token_ids is None):
        raise ValueError("give exactly one of prompts or prompt_token_ids")
    if prompts is not None:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not all(isinstance(p, str) for p in prompts):
            raise ValueError("prompts must be strings (use prompt_token_ids for ids)")
        return [(p, package.encode(p)) for p in prompts]
    ids = list(prompt_token_ids)
    if ids and all(isinstance(t, int) for t in ids):
        ids = [ids]
    out = []
    for row in ids:
        row = list(row)
        if not row or not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
            raise ValueError("prompt_token_ids must be non-empty lists of ints")
        out.append((None, row))
    return out


def engine_from(model_dir: str | Path | ModelPackage, seed: int | None, backend_options: dict,
                **config) -> Engine:
    package = model_dir if isinstance(model_dir, ModelPackage) else ModelPackage.load(model_dir)
    engine_config = EngineConfig(**config)
    check_engine_budget(None if engine_config.dense else engine_config.token_budget, package)
    return Engine(package, engine_config, seed=seed, **backend_options)


class LLM:
    """Synchronous generation over one Engine. Keyword arguments are EngineConfig's
    (``backend``, ``token_budget`` (None = the package's default), ``dense``, ``sparse_min_ratio``
    (dense decode below that many times the budget), ``memory``,
    ``prefix_sharing``, ``max_batch``, ``max_tokens_per_step``, ``prefill_chunk``,
    ``max_seq_len``, ``threads``, and for a package with an INT8 cold tier ``kv_tiers``,
    ``hot_fraction``, ``hot_pages``, ``hot_decay``; a KV page store below the pool: ``kv_cache_dir``,
    ``kv_cache_max_gb``, ``kv_cache_host_gb``, ``kv_cache_write_through``); ``backend_options`` go to
    the backend. :meth:`close` writes the cached prefix pages to the store.

    Without ``params`` a request uses ``default_params``: the package's generation config
    (greedy when it has none). Bad input raises ValueError before anything is queued."""

    def __init__(self, model_dir: str | Path | ModelPackage, *, seed: int | None = None,
                 backend_options: dict | None = None, **config):
        self.engine = engine_from(model_dir, seed, backend_options or {}, **config)
        self.package = self.engine.package
        self.default_params = default_params(self.package.path)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.package.tokenizer

    def _decoder(self):
        return self.package if (self.package.path / "tokenizer.json").is_file() else None

    def _add(self, prompt: str | None, ids: list[int], params: SamplingParams) -> RequestTracker:
        self._check(params)
        rid = f"req-{next(self._ids)}"
        self.engine.add_request(rid, ids, params)
        return RequestTracker(rid, prompt, ids, params, self._decoder())

    def _check(self, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        check_against_package(params, self.package)

    def _run(self, trackers: dict[str, RequestTracker]) -> Iterator[RequestTracker]:
        """Step until every tracker finished; yields a tracker each time its request advanced."""
        while not all(t.finished for t in trackers.values()) and self.engine.has_unfinished():
            for seq in self.engine.step():
                tracker = trackers.get(seq.request_id)
                if tracker is None:
                    continue
                if tracker.update(seq):
                    self.engine.finish(seq)
                yield tracker

    def generate(self, prompts: str | Seq[str] | None = None,
                 params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 prompt_token_ids: Seq[int] | Seq[Seq[int]] | None = None) -> list[RequestOutput]:
        """Generate for a batch of prompts (continuous batching); outputs in prompt order."""
        reqs = normalize_prompts(self.package, prompts, prompt_token_ids)
        plist = list(params) if isinstance(params, (list, tuple)) else [params or self.default_params] * len(reqs)
        if len(plist) != len(reqs):
            raise ValueError(f"{len(plist)} SamplingParams for {len(reqs)} prompts")
        for p in plist:  # every request checked before the first is queued
            self._check(p)
        trackers: dict[str, RequestTracker] = {}
        try:
            for (text, ids), p in zip(reqs, plist):
                t = self._add(text, ids, p)
                trackers[t.request_id] = t
            for _ in self._run(trackers):
                pass
        finally:
            for rid, t in trackers.items():
                if not t.finished:
                    self.engine.abort(rid)
        return [t.snapshot() for t in trackers.values()]

    def stream(self, prompt: str | None = None, params: SamplingParams | None = None, *,
               prompt_token_ids: Seq[int] | None = None) -> Iterator[RequestOutput]:
        """Yield a snapshot of one request each time it produced a token (``delta_*`` = new
        part). Closing the iterator early cancels the request."""
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError("stream takes one prompt string")
        reqs = normalize_prompts(self.package, prompt, prompt_token_ids)
        if len(reqs) != 1:
            raise ValueError("stream takes one prompt")
        ((text, ids),) = reqs
        tracker = self._add(text, ids, params or self.default_params)
        try:
            for _ in self._run({tracker.request_id: tracker}):
                yield tracker.snapshot()
        finally:
            if not tracker.finished:
                self.engine.abort(tracker.request_id)

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        """One chat turn: render ``messages`` with the package's chat template, generate."""
        text = self.package.apply_chat_template(messages)
        ids = self.package.encode(text, add_special_tokens=False)
        t = self._add(text, ids, params or self.default_params)
        for _ in self._run({t.request_id: t}):
            pass
        return t.snapshot()

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
