"""AsyncLLM: one Engine stepped by a background thread, requests as async generators.

For the HTTP server (issue #7). The engine is single-threaded: the event
loop never touches it; ``generate``/``abort`` post commands to a queue the
engine thread drains between steps, and the thread hands each request's
snapshots back through ``loop.call_soon_threadsafe`` into that request's
asyncio queue.

Supervised: a step that raises fails only the requests of its batch (they get
``StepFailed``; the engine freed their pages) and the loop goes on. A request whose
pages could not be reserved (a copy-on-write the storage failed, ``FinishReason.ERROR``)
gets ``StepFailed`` alone. After
``max_consecutive_failures`` failed steps in a row, or a failure the engine could
not clean up (``EngineBroken``), the thread stops: ``is_alive`` turns False and
``error`` says why, so a server can report it and exit for a supervisor to restart.

Nothing is left waiting: when the thread stops (shutdown or death) it stops taking
commands, then answers the requests in flight and every command still queued with a
RuntimeError; a submission after that fails at once. ``shutdown`` stops the loop and
joins the thread before closing the engine, never under a running step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence as Seq
from pathlib import Path

from tinyserve_trt.runtime.engine import EngineBroken, StepFailed
from tinyserve_trt.runtime.generation_defaults import default_params
from tinyserve_trt.runtime.limits import check_against_package
from tinyserve_trt.runtime.llm import engine_from, normalize_prompts
from tinyserve_trt.runtime.model_package import ModelPackage
from tinyserve_trt.runtime.outputs import RequestOutput, RequestTracker
from tinyserve_trt.runtime.sampling import SamplingParams
from tinyserve_trt.runtime.sequence import FinishReason


log = logging.getLogger("tinyserve.engine")


class AsyncLLM:
    """Same constructor as ``LLM`` plus ``max_consecutive_failures`` (failed steps in a row
    after which the engine thread gives up); call ``shutdown()`` (or use ``async with``)."""

    def __init__(self, model_dir: str | Path | ModelPackage, *, seed: int | None = None,
                 backend_options: dict | None = None, max_consecutive_failures: int = 3, **config):
        if not isinstance(max_consecutive_failures, int) or max_consecutive_failures < 1:
            raise ValueError(f"max_consecutive_failures must be an int >= 1, got {max_consecutive_failures!r}")
        self.max_consecutive_failures = max_consecutive_failures
        self.engine = engine_from(model_dir, seed, backend_options or {}, **config)
        self.package = self.engine.package
        self.default_params = default_params(self.package.path)
        self._ids = itertools.count()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, tuple[RequestTracker, asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # submissions vs the thread's stop: a command is queued or refused
        self._accepting = True  # False once the engine thread stopped taking commands
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="tinyserve-engine", daemon=True)
        self._thread.start()

    # ---- event-loop side ------------------------------------------------------
    async def generate(self, prompt: str | None = None, params: SamplingParams | None = None, *,
                       prompt_token_ids: Seq[int] | None = None, request_id: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield snapshots of one request as it advances (the last has ``finished``).
        Cancelling or closing the generator aborts the request. RuntimeError at once when the
        engine thread died or was shut down, or as the last item when that happens mid-request."""
        self._check_accepting()
        reqs = normalize_prompts(self.package, prompt, prompt_token_ids)
        if len(reqs) != 1:
            raise ValueError("generate takes one prompt")
        ((text, ids),) = reqs
        params = params or self.default_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        check_against_package(params, self.package)  # before anything is queued
        rid = request_id or f"req-{next(self._ids)}"
        decoder = self.package if (self.package.path / "tokenizer.json").is_file() else None
        tracker = RequestTracker(rid, text, ids, params, decoder)
        out: asyncio.Queue = asyncio.Queue()
        self._submit(("add", tracker, out, asyncio.get_running_loop()))
        finished = False
        try:
            while True:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Cancel a request (nothing to do once the engine thread stopped: it failed them all)."""
        try:
            self._submit(("abort", request_id))
        except RuntimeError:
            pass

    async def run_on_engine(self, fn):
        """``fn(engine)`` run on the engine thread between two steps; its result (or
        exception). For consistent reads (stats, ``scheduler.check_integrity()``).
        RuntimeError when the engine thread stopped (before or while this waits)."""
        if self._stop.is_set():
            raise RuntimeError(self._stopped_reason())
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._submit(("call", fn, fut, loop))
        return await fut

    def _check_accepting(self) -> None:
        if not self._accepting or self._stop.is_set():
            raise RuntimeError(self._stopped_reason())

    def _submit(self, cmd) -> None:
        """Queue ``cmd`` for the engine thread, or RuntimeError if it stopped taking commands:
        under the lock, so a command is either refused here or answered by the thread."""
        with self._lock:
            self._check_accepting()
            self._commands.put(cmd)

    def _stopped_reason(self) -> str:
        if self._error is not None:
            return f"engine thread died: {self._error!r}"
        return "engine shut down"

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def error(self) -> BaseException | None:
        """Why the engine thread stopped serving (None while it runs or after a clean shutdown)."""
        return self._error

    def stats(self) -> dict:
        return self.engine.stats()  # plain counters read without the lock: good enough for metrics

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step (requests in flight fail with
        "engine shut down"), join it, then close the engine. If a step outlasts ``timeout``
        seconds, return without closing under it: the thread closes the engine when that
        step ends. Idempotent."""
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine thread is still in a step after %.1f s; it closes the engine when the "
                        "step ends", timeout)
            return
        self._close_engine()

    def _close_engine(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.engine.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.shutdown()

    # ---- engine thread --------------------------------------------------------
    def _send(self, rid: str, item) -> None:
        _, q, loop = self._live[rid]
        loop.call_soon_threadsafe(q.put_nowait, item)

    def _handle(self, cmd) -> None:
        if cmd[0] == "add":
            _, tracker, q, loop = cmd
            try:
                self.engine.add_request(tracker.request_id, tracker.prompt_token_ids, tracker.params)
            except ValueError as e:
                loop.call_soon_threadsafe(q.put_nowait, e)
                return
            self._live[tracker.request_id] = (tracker, q, loop)
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])
            self._live.pop(cmd[1], None)
        elif cmd[0] == "call":
            _, fn, fut, loop = cmd
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # handed to the caller, the loop goes on
                result, error = None, e

            def settle():
                if not fut.done():
                    fut.set_exception(error) if error is not None else fut.set_result(result)
            loop.call_soon_threadsafe(settle)

    def _deliver(self, seq) -> None:
        """Hand ``seq``'s new tokens to its request's tracker and the snapshot to its client."""
        entry = self._live.get(seq.request_id)
        if entry is None:
            return
        if seq.finish_reason is FinishReason.ERROR:  # its request failed alone; the engine went on
            self._send(seq.request_id, StepFailed([seq.request_id], seq.error))
            del self._live[seq.request_id]
            return
        tracker = entry[0]
        if tracker.update(seq):
            self.engine.finish(seq)
        snap = tracker.snapshot()
        self._send(seq.request_id, snap)
        if snap.finished:
            del self._live[seq.request_id]

    def _fail_step(self, e: StepFailed) -> None:
        """Answer the failed step's requests with the error; give up after too many in a row."""
        self._failures += 1
        log.error("engine step failed (%d in a row); failing requests %s", self._failures, list(e.request_ids),
                  exc_info=(type(e.cause), e.cause, e.cause.__traceback__))
        for rid in e.request_ids:
            if rid in self._live:
                self._send(rid, StepFailed([rid], e.cause))
                del self._live[rid]
        if self._failures >= self.max_consecutive_failures:
            raise EngineBroken(f"{self._failures} consecutive engine steps failed; the last: {e.cause!r}") from e

    def _loop(self) -> None:
        self._failures = 0
        cmd = None
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished()
                try:  # idle: block until a command; busy: take pending ones between steps
                    cmd = self._commands.get_nowait() if busy else self._commands.get()
                except queue.Empty:
                    cmd = None
                if cmd is not None:
                    self._handle(cmd)
                    cmd = None
                    continue  # drain every pending command before the next step
                try:
                    seqs = self.engine.step()
                except StepFailed as e:
                    self._fail_step(e)
                    continue
                self._failures = 0  # consecutive: a step that ran resets it
                for seq in seqs:
                    try:
                        self._deliver(seq)
                    except Exception as e:  # one request's text/stop handling failed: fail that request
                        log.error("delivering %s failed; failing the request", seq.request_id, exc_info=True)
                        self.engine.abort(seq.request_id)
                        if seq.request_id in self._live:
                            self._send(seq.request_id, StepFailed([seq.request_id], e))
                            del self._live[seq.request_id]
        except BaseException as e:  # surface to every waiting request, then stop
            log.critical("the engine thread stopped: %r", e, exc_info=True)
            self._error = e
        finally:
            self._stop_taking_commands([cmd] if cmd is not None else [])

    def _stop_taking_commands(self, pending: list) -> None:
        """The thread is leaving: refuse new commands, then answer the requests in flight, the
        command in hand (``pending``) and every queued one; close the engine on a shutdown."""
        with self._lock:
            self._accepting = False
        while True:
            try:
                pending.append(self._commands.get_nowait())
            except queue.Empty:
                break
        reason = self._stopped_reason()
        for _, q, loop in self._live.values():
            _post(loop, q.put_nowait, RuntimeError(reason))
        self._live.clear()
        for cmd in pending:
            if cmd[0] == "add":
                _post(cmd[3], cmd[2].put_nowait, RuntimeError(reason))
            elif cmd[0] == "call":
                fut = cmd[2]
                _post(cmd[3], lambda f=fut: f.done() or f.set_exception(RuntimeError(reason)))
        if self._stop.is_set():  # shutdown asked: the engine is closed here, after the last step
            self._close_engine()


def _post(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """``fn(*args)`` on ``loop``; nothing when that loop is closed (nobody is waiting there)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass
