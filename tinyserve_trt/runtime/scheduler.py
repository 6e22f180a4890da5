"""Scheduler: continuous batching of chunked prefill and decode over a PagePool.

The scheduler decides which sequences run and how many tokens each computes; the
page pool owns page ids. A step is either a decode step (one new token per row) or a
prefill step (chunks of several tokens), alternating when both are pending (see
``schedule``). Each step, running sequences of its kind go first (oldest first), then
waiting ones are admitted while the batch, token and page limits allow. When pages
run out the NEWEST running sequence is preempted: its pages are released (full ones
stay in the prefix cache) and it is requeued to recompute, so the oldest always
progresses. Requests are checked at ``add`` to fit the pool alone, so no request is
ever dropped and the pool running dry never raises. A page operation that raises
(a storage failing a copy-on-write) is undone by the pool and fails only the request
that needed it: its sequences finish with ``FinishReason.ERROR`` (``take_failed``).
A queued request's stored prefix pages (a page store below the prefix cache) are read in the
background while it waits (``PrefixCache.prefetch``); its admission takes them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence as Seq

import numpy as np

from tinyserve_trt.runtime.batch import ScheduledBatch
from tinyserve_trt.runtime.config import SchedulerConfig
from tinyserve_trt.runtime.pages import PagePool, PoolIntegrityError
from tinyserve_trt.runtime.prefix_cache import PrefixCache, make_prefix_cache
from tinyserve_trt.runtime.sampling import SampleOutput, SamplingParams
from tinyserve_trt.runtime.sequence import FinishReason, Sequence, SequenceStatus


class Scheduler:
    """Owns the waiting queue and the running list; see the module docstring."""

    def __init__(self, config: SchedulerConfig, pool: PagePool, prefix_cache: PrefixCache | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.pool = pool
        self.prefix_cache = prefix_cache or make_prefix_cache(pool.config.prefix_cache, pool)
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: newest last
        self._requests: dict[str, list[Sequence]] = {}  # live sequences by request id
        self._in_flight: ScheduledBatch | None = None
        self._last_wide: bool | None = None  # kind of the last non-empty batch
        self.num_preemptions = 0
        self.failed: list[Sequence] = []  # finished with an error, not yet taken (take_failed)
        self._prefetches: dict[tuple[str, int], object] = {}  # queued, not yet admitted: store reads

    # ---- requests -----------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams | None = None) -> Sequence:
        """Queue a request. ValueError if its id is live, the prompt is empty, or it cannot fit.

        A request fits when prompt + max_tokens (capped at max_seq_len) fits the pool alone.
        """
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already live")
        if not prompt or min(prompt) < 0:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids >= 0")
        total = len(prompt) + params.max_tokens
        if self.config.max_seq_len is not None:
            if len(prompt) >= self.config.max_seq_len:
                raise ValueError(f"prompt of {len(prompt)} tokens leaves no room under "
                                 f"max_seq_len={self.config.max_seq_len}")
            total = min(total, self.config.max_seq_len)
        capacity = self.pool.num_pages * self.pool.page_size
        if total > capacity:
            raise ValueError(f"request needs up to {total} tokens of KV cache; the pool holds "
                             f"{capacity} ({self.pool.num_pages} pages of {self.pool.page_size})")
        seq = Sequence(request_id, prompt, params)
        seq.stats.arrival_time = self.clock()
        self._requests[request_id] = [seq]
        self.waiting.append(seq)
        handle = self.prefix_cache.prefetch(seq.token_ids[:seq.num_tokens - 1])  # what admission matches
        if handle is not None:
            self._prefetches[(request_id, seq.index)] = handle
        return seq

    def cancel(self, request_id: str) -> bool:
        """Finish every sequence of ``request_id`` as cancelled and free its pages now.

        Safe between ``schedule`` and ``postprocess``: the cancelled rows' slots in the
        in-flight batch become -1 so their K/V are not written. Returns False if unknown.
        """
        seqs = list(self._requests.get(request_id, ()))
        for seq in seqs:
            self.finish(seq, FinishReason.CANCELLED)
        return bool(seqs)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End ``seq`` (e.g. the engine matched a stop string) and release its pages."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.prefix_cache.drop_prefetch(self._prefetches.pop((seq.request_id, seq.index), None))
        else:
            self.running.remove(seq)
        self._release(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason(reason)
        seq.stats.finish_time = self.clock()
        group = self._requests[seq.request_id]
        group.remove(seq)
        if not group:
            del self._requests[seq.request_id]
        batch = self._in_flight
        if batch is not None:
            for row, s in enumerate(batch.seqs):
                if s is seq:
                    batch.slot_mapping[row] = -1

    def fork(self, seq: Sequence, n: int) -> list[Sequence]:
        """``n`` new sequences continuing ``seq``, sharing its pages until one writes (copy-on-write).

        Children take the next sample indices of the request; they join ``seq``'s
        queue (running children are the newest, so preempted first).
        """
        if seq.is_finished:
            raise ValueError(f"cannot fork finished sequence {seq!r}")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        group = self._requests[seq.request_id]
        next_index = max(s.index for s in group) + 1
        children = []
        for i in range(n):
            child = Sequence(seq.request_id, seq.prompt_token_ids, seq.params, index=next_index + i,
                             token_ids=list(seq.token_ids), status=seq.status, pages=list(seq.pages),
                             num_cached_tokens=seq.num_cached_tokens, page_hashes=list(seq.page_hashes),
                             forked=True)
            child.stats.arrival_time = seq.stats.arrival_time
            for page in child.pages:
                self.pool.incref(page)
            (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).append(child)
            group.append(child)
            children.append(child)
        return children

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Pick this step's rows, reserve (and copy-on-write) their pages, build the arrays.

        A batch is either narrow (every row computes one token: decode steps) or wide
        (prefill chunks of more than one token), never both: the op attends every page
        of every row when the batch has more than one new token per row, so a decode row
        batched with a prefill chunk would lose its sparse selection (and pay for the
        chunk's padded width). When both kinds are pending the steps alternate, so long
        prefills do not stall running decodes and new requests are not starved.

        Returns an empty batch when nothing can run. Call ``postprocess`` before
        scheduling again.
        """
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before postprocess() of the previous batch")
        narrow = any(s.num_uncached_tokens == 1 for s in self.running)
        wide = bool(self.waiting) or any(s.num_uncached_tokens > 1 for s in self.running)
        kinds = [self._last_wide is False] if narrow and wide else [wide]
        kinds.append(not kinds[0])
        for want_wide in kinds:  # the other kind too when the first one had nothing to run
            rows = self._pick(want_wide)
            if rows:
                self._last_wide = want_wide
                break
        batch = ScheduledBatch.build(rows, self.pool.page_size, self.config.token_budget,
                                     self.config.sparse_min_ratio, self.config.budget_share)
        self._in_flight = batch
        return batch

    def _pick(self, wide: bool) -> list[tuple[Sequence, int]]:
        """Rows of one kind (``n_new > 1`` if ``wide``, else ``n_new == 1``) with their pages reserved."""
        cfg = self.config
        budget = cfg.max_tokens_per_step
        rows: list[tuple[Sequence, int]] = []
        preempted = False
        for seq in list(self.running):  # a copy: preemptions and failures remove sequences
            if len(rows) >= cfg.max_batch or budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # failed (a sibling's reservation raised) or preempted this step
            n_new = min(seq.num_uncached_tokens, cfg.prefill_chunk, budget)
            if (n_new > 1) != wide:
                continue
            try:
                while not self._reserve(seq, n_new):
                    victim = self.running[-1]  # newest; never one already in rows (those are older)
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
            except Exception as e:  # the pool undid the failed operation: fail this request only
                rows, budget = self._fail(seq, e, rows)
                continue
            if seq.status is not SequenceStatus.RUNNING:
                break
            rows.append((seq, n_new))
            budget -= n_new
        # Admitting right after a preemption would only thrash.
        while self.waiting and not preempted and len(rows) < cfg.max_batch and budget > 0:
            seq = self.waiting[0]
            first = seq.stats.first_scheduled_time is None
            if not seq.pages:
                pages, hashes = self.prefix_cache.match(seq.token_ids[:seq.num_tokens - 1],
                                                        prefetch=self._prefetches.pop((seq.request_id, seq.index),
                                                                                      None))
                seq.pages, seq.page_hashes = pages, hashes
                seq.num_cached_tokens = len(pages) * self.pool.page_size
                if first:
                    self._note_tiers(seq)
            n_new = min(seq.num_uncached_tokens, cfg.prefill_chunk, budget)
            try:
                reserved = (n_new > 1) == wide and self._reserve(seq, n_new)
            except Exception as e:
                rows, budget = self._fail(seq, e, rows)
                continue
            if not reserved:
                self._release(seq)  # first in line: it waits for a step of its kind (or for pages)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if first:
                seq.stats.first_scheduled_time = self.clock()
                seq.stats.prefix_pages_reused = seq.num_cached_tokens // self.pool.page_size
                seq.stats.prefix_tokens_reused = seq.num_cached_tokens
            self.running.append(seq)
            rows.append((seq, n_new))
            budget -= n_new
        return rows

    def _note_tiers(self, seq: Sequence) -> None:
        """Where the pages of ``seq``'s latest match came from. Pages a previous match of it
        restored from the store (before it had to wait) are now in the pool: still theirs."""
        tiers = dict(self.prefix_cache.last_match_tiers)
        for tier in ("host", "disk"):
            moved = min(seq.stats.prefix_pages_by_tier.get(tier, 0), tiers.get("pool", 0))
            if moved:
                tiers[tier] = tiers.get(tier, 0) + moved
                tiers["pool"] -= moved
        seq.stats.prefix_pages_by_tier = {t: n for t, n in tiers.items() if n}

    def _fail(self, seq: Sequence, error: Exception, rows: list[tuple[Sequence, int]]
              ) -> tuple[list[tuple[Sequence, int]], int]:
        """``seq``'s page reservation raised: finish every sequence of its request with
        ``FinishReason.ERROR`` (``error`` on each, for :meth:`take_failed`) and check that the
        pool is whole (PoolIntegrityError if the failed operation was not undone). Returns
        ``rows`` without that request's sequences and the token budget left."""
        for s in list(self._requests.get(seq.request_id, ())):
            s.error = error
            self.finish(s, FinishReason.ERROR)
            self.failed.append(s)
        self.check_integrity()
        rows = [(s, n) for s, n in rows if not s.is_finished]
        return rows, self.config.max_tokens_per_step - sum(n for _, n in rows)

    def take_failed(self) -> list[Sequence]:
        """Sequences finished with ``FinishReason.ERROR`` since the last call (their
        ``error`` says why); the engine reports them to their callers."""
        failed, self.failed = self.failed, []
        return failed

    def postprocess(self, batch: ScheduledBatch, sampled: SampleOutput | np.ndarray) -> list[Sequence]:
        """Advance the batch's sequences after the model ran and their K/V were written.

        ``sampled`` is the Sampler's output or ``[batch]`` token ids (read only where
        ``batch.sample_mask``). Registers newly full pages in the prefix cache, appends
        tokens, forks ``n > 1`` requests after their prompt, finishes on stop tokens /
        EOS / max_tokens / max_seq_len. Returns the sequences finished by this step.
        """
        if batch is not self._in_flight:
            raise RuntimeError("postprocess() expects the batch returned by the last schedule()")
        self._in_flight = None
        out = sampled if isinstance(sampled, SampleOutput) else SampleOutput(np.asarray(sampled))
        if out.token_ids.shape != (len(batch),):
            raise ValueError(f"expected {len(batch)} sampled tokens, got shape {out.token_ids.shape}")
        finished = []
        for row, seq in enumerate(batch.seqs):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # cancelled or finished while in flight
            seq.num_cached_tokens += int(batch.num_new_tokens[row])
            seq.page_hashes = self.prefix_cache.insert(seq.token_ids[:seq.num_cached_tokens],
                                                       seq.pages, seq.page_hashes)
            if not batch.sample_mask[row]:
                continue
            if seq.params.n > 1 and not seq.forked:
                seq.forked = True
                for child in self.fork(seq, seq.params.n - 1):
                    child.num_cached_tokens -= 1  # recompute the last prompt token: own first sample
            token = int(out.token_ids[row])
            seq.token_ids.append(token)
            if out.logprobs is not None and seq.params.logprobs is not None:
                seq.output_logprobs.append(float(out.logprobs[row]))
                seq.output_top_logprobs.append(out.top_logprobs[row] if out.top_logprobs else [])
            if seq.stats.first_token_time is None:
                seq.stats.first_token_time = self.clock()
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    # ---- internals ----------------------------------------------------------
    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        eos = self.config.eos_token_id
        if token in p.stop_token_ids or (eos is not None and token == eos and not p.ignore_eos):
            return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens:
            return FinishReason.LENGTH
        if self.config.max_seq_len is not None and seq.num_tokens >= self.config.max_seq_len:
            return FinishReason.LENGTH
        return None

    def _reserve(self, seq: Sequence, n_new: int) -> bool:
        """Make slots ``[num_cached, num_cached + n_new)`` writable pages of ``seq``.

        Copies shared pages it will write into (copy-on-write) and allocates the
        missing ones. Returns False, changing nothing, when the pool is short. A pool
        operation that raises was undone by the pool; the copies made before it are kept
        (``seq`` holds them), and the exception propagates.
        """
        ps = self.pool.page_size
        first, end = seq.num_cached_tokens // ps, -(-(seq.num_cached_tokens + n_new) // ps)
        shared = []
        for j in range(first, min(end, len(seq.pages))):
            page = seq.pages[j]
            if not self.pool.is_writable(page):
                if self.pool.refcount(page) == 1:
                    self.prefix_cache.discard(page)  # sole holder: drop the entry, write in place
                else:
                    shared.append(j)
        missing = max(0, end - len(seq.pages))
        if len(shared) + missing > self.pool.num_available:
            return False
        for j in shared:
            src = seq.pages[j]
            # allocate + copy is one transaction: if the copy raises, the page goes back free
            (dst,) = self.pool.allocate(1, fill=lambda pages, src=src: self.pool.copy_page(src, pages[0]))
            self.pool.decref(src)
            seq.pages[j] = dst
        seq.pages.extend(self.pool.allocate(missing))
        return True

    def _release(self, seq: Sequence) -> None:
        # Tail pages first, so a prefix's deeper pages are evicted before its head.
        for page in reversed(seq.pages):
            self.pool.decref(page)
        seq.pages, seq.page_hashes, seq.num_cached_tokens = [], [], 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.stats.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)  # newest preempted first, so the oldest ends up in front

    def check_integrity(self) -> None:
        """Raise PoolIntegrityError unless sequences, pool and prefix cache agree."""
        live = list(self.waiting) + self.running
        if len({id(s) for s in live}) != len(live):
            raise PoolIntegrityError("a sequence is queued twice")
        ps = self.pool.page_size
        for seq in live:
            if seq.status is SequenceStatus.WAITING and seq.pages:
                raise PoolIntegrityError(f"waiting {seq!r} holds pages")
            if seq.status is SequenceStatus.RUNNING and len(seq.pages) * ps < seq.num_cached_tokens:
                raise PoolIntegrityError(f"{seq!r} has cached tokens beyond its pages")
            if seq.is_finished:
                raise PoolIntegrityError(f"finished {seq!r} is still queued")
        if sum(len(g) for g in self._requests.values()) != len(live):
            raise PoolIntegrityError("request index disagrees with the queues")
        self.pool.check_integrity([s.pages for s in live])
        self.prefix_cache.check_integrity()
