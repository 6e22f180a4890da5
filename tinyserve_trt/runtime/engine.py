"""Engine: the serving loop - schedule -> backend.run -> sample -> postprocess.

Owns the page pool, the scheduler (and through it the prefix cache), the
backend and the sampler. Single-threaded: ``LLM`` drives it directly,
``AsyncLLM`` from one background thread. Text (tokenizer, stop strings) is
the callers' business; the engine works on token ids.

With a package that has an INT8 cold tier (and ``EngineConfig.kv_tiers``), the
pool is a ``TieredPagePool`` and each step also feeds the op's page
selections to the hotness policy and demotes between steps (``tiers/tiering.py``).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import replace

import numpy as np

from tinyserve_trt.runtime.backends import make_backend
from tinyserve_trt.runtime.backends.base import StepOutput
from tinyserve_trt.runtime.backends.kernel_report import KernelReport, NativeRequired, cold_format_of
from tinyserve_trt.runtime.batch import ScheduledBatch
from tinyserve_trt.runtime.config import EngineConfig
from tinyserve_trt.runtime.model_package import ModelPackage
from tinyserve_trt.runtime.pages import PagePool
from tinyserve_trt.runtime.prefix_cache import make_prefix_cache
from tinyserve_trt.runtime.sampling import SampleOutput, Sampler, SamplingParams
from tinyserve_trt.runtime.scheduler import Scheduler
from tinyserve_trt.runtime.sequence import FinishReason, Sequence
from tinyserve_trt.runtime.tiers.tiering import Tiering

log = logging.getLogger("tinyserve.runtime")


class StepFailed(RuntimeError):
    """One step raised. The requests it ran (``request_ids``) were aborted and their pages
    freed; the pool passed ``check_integrity()``, so the engine can go on serving."""

    def __init__(self, request_ids, cause: BaseException):
        super().__init__(f"engine step failed: {cause!r}")
        self.request_ids, self.cause = tuple(request_ids), cause


class EngineBroken(RuntimeError):
    """A failed step could not be cleaned up (or the pool's invariants no longer hold):
    the engine must not serve again."""


class Engine:
    """A model package served over a paged KV pool; see the module docstring."""

    def __init__(self, package: ModelPackage, config: EngineConfig = EngineConfig(), seed: int | None = None,
                 **backend_options):
        self.package, self.config = package, config
        cache = config.cache_config(page_size=package.page_size, num_layers=package.num_layers,
                                    num_kv_heads=package.num_kv_heads, head_dim=package.head_dim,
                                    dtype=package.dtype, max_context=package.max_context)
        cache = replace(cache, sub_page_size=package.sub_page_size)  # the pool keeps key_sub_bounds
        eos = package.eos_token_ids
        self.budget = config.decode_budget(package)
        self.token_budget = self.budget.tokens
        self.tiering = Tiering(package, cache, config) if config.kv_tiers and package.cold_tier else None
        self.pool = self.tiering.pool if self.tiering else PagePool(cache, package.num_layers, package.num_kv_heads,
                                                                    package.head_dim)
        self.store = _page_store(package, cache, config)
        prefix = make_prefix_cache(cache.prefix_cache, self.pool, **(
            dict(store=self.store, write_through=config.kv_cache_write_through) if self.store else {}))
        self.scheduler = Scheduler(config.scheduler_config(budget=self.budget,
                                                           eos_token_id=eos[0] if eos else None), self.pool,
                                   prefix_cache=prefix)
        if config.threads is not None:
            backend_options.setdefault("threads", config.threads)
        if config.backend == "ort" and config.ort_provider != "auto":
            backend_options.setdefault("provider", config.ort_provider)
        if config.backend == "ort" and config.trust_package_engines:  # engines shipped in the package (opt-in)
            backend_options.setdefault("trust_package_engines", True)
        if config.backend == "ort" and config.native_arch is not None:
            backend_options.setdefault("native_arch", config.native_arch)
        if config.backend in ("ort", "trt") and config.plugin_dir is not None:
            backend_options.setdefault("plugin_dir", str(config.plugin_dir))
        if config.backend == "trt" and not config.cuda_graphs:
            backend_options.setdefault("cuda_graphs", False)
        self.backend = make_backend(config.backend, package, self.pool, **backend_options)
        if self.tiering and not self.backend.reads_cold_pages:
            raise ValueError(f"backend {config.backend!r} cannot read INT8 cold pages; use kv_tiers=False")
        self.kernel_report = self._kernel_report(config)
        self.sampler = Sampler(seed)
        self._sparse_layers = [i for i, layer in enumerate(package.layers) if layer.get("policy") != "dense"]
        self._observed_layers = self._sparse_layers or list(range(package.num_layers))  # hotness: selections
        self.peak_pages_in_use = 0  # pages holding K/V at once, at most (memory_report.py)
        self._unsettled: ScheduledBatch | None = None  # scheduled, not yet handed to postprocess
        self.counters = dict(steps=0, prefill_tokens=0, decode_tokens=0, prompt_tokens=0, prefix_tokens_reused=0,
                             pages_selected=0.0, pages_available=0, step_failures=0,
                             prefix_pages_pool=0, prefix_pages_host=0, prefix_pages_disk=0)
        self._ttfts: dict[str, deque] = {}  # prefix source -> recent TTFTs (s), for stats()
        self._ttft_totals: dict[str, list] = {}  # prefix source -> [requests, seconds] since start

    def _kernel_report(self, config: EngineConfig) -> KernelReport | None:
        """The backend's report with the cold format served, logged once (WARNING for a fallback);
        with ``config.require_native`` a decode kernel that is not native closes the backend and
        raises NativeRequired (one line)."""
        report = self.backend.kernel_report()
        if report is not None:
            report = report.with_cold_format(cold_format_of(self.package, self.tiering is not None))
        if config.require_native and (report is None or not report.native):
            self.backend.close()
            if report is None:
                raise NativeRequired(f"a native decode kernel is required (require_native) but backend "
                                     f"{config.backend!r} does not report what it runs")
            report.check_native()
        if report is not None:
            log.log(logging.WARNING if report.fallback else logging.INFO, "%s: %s", self.package.path, report.line())
        return report

    # ---- requests -------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams | None = None
                    ) -> Sequence:
        """Queue a request; ValueError for ids outside the vocabulary or a request the pool cannot hold."""
        vocab = self.package.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        params = params or SamplingParams()
        if len(self.package.eos_token_ids) > 1 and not params.ignore_eos:  # a model may have several EOS
            params = replace(params, stop_token_ids=tuple(params.stop_token_ids) + self.package.eos_token_ids[1:])
        return self.scheduler.add(request_id, prompt_token_ids, params)

    def abort(self, request_id: str) -> bool:
        """Cancel every sequence of ``request_id`` and free its pages; False if unknown."""
        return self.scheduler.cancel(request_id)

    def finish(self, seq: Sequence, reason: FinishReason = FinishReason.STOP) -> None:
        """End ``seq`` early (a stop string matched) and free its pages."""
        self.scheduler.finish(seq, reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one batch. Returns the sequences that sampled a token (finished ones included)
        and those whose request failed in this step's scheduling (``FinishReason.ERROR``, their
        ``error`` set: a page operation for them raised and was undone; the others ran).

        Supervised: if anything in the step raises, its requests are aborted and StepFailed
        is raised (the engine stays usable); EngineBroken if that cleanup fails too."""
        batch, failed = None, []
        try:
            batch = self._unsettled = self.scheduler.schedule()
            failed = self.scheduler.take_failed()
            return self._run(batch) + failed
        except Exception as e:
            raise self._failed(batch, e, failed + self.scheduler.take_failed()) from e
        finally:
            self._unsettled = None

    def _failed(self, batch: ScheduledBatch | None, error: Exception, failed: list[Sequence]) -> RuntimeError:
        """Abort the failed step's requests (every unfinished one if it failed before a batch
        existed), then check the pool; the exception for ``step`` to raise. ``failed``: sequences
        that already failed in this step's scheduling; their requests are named in it too."""
        self.counters["step_failures"] += 1
        try:
            seqs = batch.seqs if batch is not None else [*self.scheduler.waiting, *self.scheduler.running]
            request_ids = list(dict.fromkeys(s.request_id for s in [*seqs, *failed]))
            for rid in request_ids:
                self.scheduler.cancel(rid)
            if batch is not None and self._unsettled is batch:  # the scheduler still waits for it
                self.scheduler.postprocess(batch, SampleOutput(np.full(len(batch), -1, np.int64)))
            self.scheduler.check_integrity()
        except Exception as cleanup:
            return EngineBroken(f"engine step failed ({error!r}) and its cleanup failed too ({cleanup!r})")
        return StepFailed(request_ids, error)

    def _run(self, batch: ScheduledBatch) -> list[Sequence]:
        out = self.backend.run(batch)
        self.peak_pages_in_use = max(self.peak_pages_in_use, self.pool.num_pages - self.pool.num_free)
        sampled = self.sampler(out.logits, batch.seqs, batch.sample_mask)
        self._record(batch, out)
        if self.tiering:  # while the batch's page handles are still held
            self.tiering.observe(batch, out.selected_pages, self._observed_layers)
        self._unsettled = None  # from here on the scheduler no longer holds it in flight
        self.scheduler.postprocess(batch, sampled)
        self._record_first_tokens(batch)
        if self.tiering:
            self.tiering.rebalance([s.pages for s in self.scheduler.running])
        return [seq for seq, sampled_row in zip(batch.seqs, batch.sample_mask) if sampled_row]

    def _record(self, batch: ScheduledBatch, out: StepOutput) -> None:
        c = self.counters
        c["steps"] += 1
        decode = (batch.num_new_tokens == 1) & (batch.past_lens > 0)
        c["decode_tokens"] += int(decode.sum())
        c["prefill_tokens"] += int(batch.num_new_tokens[~decode].sum())
        for seq, past in zip(batch.seqs, batch.past_lens):
            if seq.index == 0 and seq.stats.first_token_time is None and seq.stats.num_preemptions == 0 \
                    and past == seq.stats.prefix_tokens_reused:  # first chunk of a first admission
                c["prompt_tokens"] += seq.num_prompt_tokens
                c["prefix_tokens_reused"] += seq.stats.prefix_tokens_reused
                for tier, n in seq.stats.prefix_pages_by_tier.items():
                    c[f"prefix_pages_{tier}"] += n
        if out.selected_pages is None or not self._sparse_layers or not decode.any():
            return
        stacked = np.concatenate([out.selected_pages[i] for i in self._sparse_layers], axis=1)
        batch.record_selected_pages(stacked, rows=decode)
        per_row = stacked.sum(axis=2).mean(axis=1)
        c["pages_selected"] += float(per_row[decode].sum())
        c["pages_available"] += int((-(-batch.past_lens[decode] // self.pool.page_size)).sum())

    def _record_first_tokens(self, batch: ScheduledBatch) -> None:
        """TTFT of each request that got its first token this step, by where its prefix came from."""
        for seq, sampled in zip(batch.seqs, batch.sample_mask):
            if sampled and seq.index == 0 and seq.num_output_tokens == 1 and seq.stats.ttft is not None:
                src = seq.stats.prefix_source
                self._ttfts.setdefault(src, deque(maxlen=1024)).append(seq.stats.ttft)
                total = self._ttft_totals.setdefault(src, [0, 0.0])
                total[0] += 1
                total[1] += seq.stats.ttft

    # ---- stats ----------------------------------------------------------------
    def stats(self) -> dict:
        """Pool use, prefix hit rate and decode page-selection rate so far, and what runs
        (``kernel_*``: the kernel report)."""
        c, pool = self.counters, self.pool
        prefetcher = getattr(self.scheduler.prefix_cache, "prefetcher", None)
        in_use = len(pool.in_use_pages())
        return dict(
            steps=c["steps"], prefill_tokens=c["prefill_tokens"], decode_tokens=c["decode_tokens"],
            token_budget=self.token_budget, page_size=pool.page_size,
            pages_total=pool.num_pages, pages_in_use=in_use, pages_free=pool.num_free,
            pages_cached_idle=pool.num_evictable, prefix_cache_entries=self.scheduler.prefix_cache.num_entries,
            prefix_hit_rate=c["prefix_tokens_reused"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
            page_selection_rate=c["pages_selected"] / c["pages_available"] if c["pages_available"] else None,
            preemptions=self.scheduler.num_preemptions, step_failures=c["step_failures"],
            prefix_pages_pool=c["prefix_pages_pool"], prefix_pages_host=c["prefix_pages_host"],
            prefix_pages_disk=c["prefix_pages_disk"],
            # p50/mean over the latest 1024 requests of each source; requests/sum_s since start
            ttft_by_prefix_source={src: dict(requests=self._ttft_totals[src][0], sum_s=self._ttft_totals[src][1],
                                             p50_ms=statistics.median(t) * 1e3, mean_ms=statistics.fmean(t) * 1e3)
                                   for src, t in self._ttfts.items()},
            **({f"kv_store_{k}": v for k, v in self.store.stats().items()} if self.store else {}),
            **({f"kv_{k}": v for k, v in prefetcher.stats().items()} if prefetcher else {}),
            **(self.tiering.stats() if self.tiering else {}),
            **(self.backend.transfer.stats() if getattr(self.backend, "transfer", None) else {}),
            **(self.kernel_report.stats() if self.kernel_report else {}),
        )

    def close(self) -> None:
        """Write the cached prefix pages to the page store (they survive a restart), then close."""
        try:
            if self.store is not None:
                self.scheduler.prefix_cache.close()  # no prefetch reads once the store closes
                self.scheduler.prefix_cache.flush()
                self.store.close()
        finally:
            self.backend.close()


def _page_store(package: ModelPackage, cache, config: EngineConfig):
    """The page store of ``config`` (``kv_cache_dir`` / ``kv_cache_host_gb``) for this pool, or None."""
    if config.kv_cache_dir is None and not config.kv_cache_host_gb:
        return None
    from tinyserve_trt.runtime.kvstore import StoreIdentity, make_page_store

    identity = StoreIdentity.of_package(package, dtype=cache.dtype, sub_page_size=cache.sub_page_size)
    tier = package.cold_tier if config.kv_tiers else None
    if tier:  # some pages were cold (lossy) before they were stored: a store of their own
        identity = replace(identity, format=f"{identity.format}+{tier.get('cold_format', 'int8')}-{config.kv_scales}")
    name = "host" if config.kv_cache_dir is None else "host+disk"
    return make_page_store(name, identity, host_bytes=int(config.kv_cache_host_gb * 2**30),
                           directory=config.kv_cache_dir, disk_bytes=int(config.kv_cache_max_gb * 2**30),
                           background=True)  # disk writes leave the step: a writer thread does them
