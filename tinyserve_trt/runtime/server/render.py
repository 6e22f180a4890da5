"""Renderer: the package's chat template and tokenizer run in worker processes, under limits.

A package's chat template and tokenizer are input, not code we wrote (STYLE 15). jinja2's
``ImmutableSandboxedEnvironment`` (``ModelPackage.apply_chat_template``) keeps a template
from touching Python objects, but not from using time or memory: ``range`` is capped per
call, yet nested loops multiply, and ``'x' * 10**10`` is one C call (made while the
template compiles) that no check inside the sandbox - a counting ``call``/``getattr``
hook, a deadline - can interrupt. A thread cannot be stopped either. A process can:

* each worker (``python -m tinyserve_trt.runtime.server.render PKG BYTES``) loads the
  package once, then caps its own data memory (``RLIMIT_DATA``: heap and private
  mappings, Linux) at what it uses after loading plus ``memory_bytes``. An allocation
  past that is a MemoryError in the worker: that job is refused and the worker exits;
* the server waits for a job's answer off the event loop (pipes) for at most
  ``timeout_s``; past it the worker is killed (SIGKILL) and a fresh one is started for a
  later job. Time and memory are bounded whatever the template does;
* a rendered text, or a prompt, longer than the job's ``max_chars`` is refused before it
  is tokenized (the output-size limit; the server passes its context in characters), and
  one of ``max_tokens`` tokens or more after it (its ids are not sent back).

Jobs and answers are length-prefixed JSON over the worker's stdin/stdout (never pickle:
the worker runs untrusted templates, and nothing it sends back can run code here); token
ids travel as base64 int32, which the event loop decodes in a few ms.
At most ``workers`` jobs run at once; more wait for a worker. Workers start on first use
and exit when the server closes the renderer or, failing that, when their stdin closes.

What it does not do: it is no operating-system sandbox (a worker has the server's user
and files; jinja2's sandbox is what keeps a template from reaching them). Errors are
``RenderError``: ``kind`` is one of ``timeout``, ``memory``, ``too_long``, ``template``
(the template raised), ``package`` (no tokenizer / template), ``tokenizer``, ``failed``
(the worker died mid-job) and ``start`` (no worker could start).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
import sys
from array import array
from pathlib import Path

_HEADER = struct.Struct(">Q")
MAX_REPLY_BYTES = 1 << 30  # an answer larger than this is a broken worker, not token ids
START_TIMEOUT = 120.0  # seconds for a worker to load the package (imports, tokenizer)


class RenderError(Exception):
    """A job the worker refused or could not finish; ``kind`` says why (module docstring)."""

    def __init__(self, kind: str, message: str, chars: int | None = None, tokens: int | None = None):
        super().__init__(message)
        self.kind, self.message, self.chars, self.tokens = kind, message, chars, tokens


def longest_token_chars(package) -> int | None:
    """Characters of the longest token string in the package's vocabulary (added tokens
    included), or None without a tokenizer. A text of ``c`` characters has at least
    ``c / longest`` tokens unless the tokenizer's normalizer deletes most of its characters:
    a cheap lower bound the server checks before tokenizing anything."""
    try:
        vocab = package.tokenizer.get_vocab(with_added_tokens=True)
    except Exception:  # PackageError: no tokenizer.json (token-id prompts only)
        return None
    return max((len(token) for token in vocab), default=1) or 1


# ---- the server's side ----------------------------------------------------------------
async def _read_frame(stream: asyncio.StreamReader):
    (size,) = _HEADER.unpack(await stream.readexactly(_HEADER.size))
    if size > MAX_REPLY_BYTES:
        raise ValueError(f"a worker answer of {size} bytes")
    return json.loads(await stream.readexactly(size))


def _frame(obj) -> bytes:
    data = json.dumps(obj).encode("ascii")  # ASCII: a lone surrogate in a message travels as its escape
    return _HEADER.pack(len(data)) + data


def _pack_ids(ids: list[int]) -> str:
    return base64.b64encode(array("i", ids).tobytes()).decode("ascii")


def _unpack_ids(text: str) -> list[int]:
    a = array("i")
    a.frombytes(base64.b64decode(text, validate=True))
    return a.tolist()


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    @classmethod
    async def start(cls, package_dir: str, memory_bytes: int) -> _Worker:
        root = str(Path(__file__).resolve().parents[3])  # so the worker imports this very tinyserve_trt
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
                   TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1", OMP_NUM_THREADS="1")
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tinyserve_trt.runtime.server.render", package_dir, str(memory_bytes),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
        except OSError as e:
            raise RenderError("start", f"the render worker could not start ({type(e).__name__})") from None
        worker = cls(proc)
        try:
            ready = await asyncio.wait_for(_read_frame(proc.stdout), START_TIMEOUT)
        except asyncio.CancelledError:
            worker.kill()
            raise
        except Exception:
            worker.kill()
            raise RenderError("start", "the render worker did not start (see the server log)") from None
        if ready != {"ready": True}:
            worker.kill()
            raise RenderError("start", "the render worker did not start (see the server log)")
        return worker

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def ask(self, job: dict) -> dict:
        self.proc.stdin.write(_frame(job))
        await self.proc.stdin.drain()
        return await _read_frame(self.proc.stdout)

    def kill(self) -> None:
        if self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass


class Renderer:
    """Render chat messages / tokenize prompts of one package in worker processes (see the
    module docstring). Event-loop side only; one event loop per instance."""

    def __init__(self, package_dir, *, workers: int = 2, timeout_s: float = 2.0, memory_bytes: int = 1 << 30):
        self.package_dir, self.workers = str(package_dir), workers
        self.timeout_s, self.memory_bytes = timeout_s, memory_bytes
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._killed: set[_Worker] = set()  # until close() has reaped them
        self._slots: asyncio.Semaphore | None = None

    @classmethod
    def from_config(cls, package_dir, config) -> Renderer:
        """The workers a ``ServerConfig`` asks for (``render_workers``, ``render_timeout_s``,
        ``render_memory_bytes``)."""
        return cls(package_dir, workers=config.render_workers, timeout_s=config.render_timeout_s,
                   memory_bytes=config.render_memory_bytes)

    async def chat(self, messages: list[dict], max_chars: int, max_tokens: int | None = None) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template (the template's special
        tokens are in its text: no others are added)."""
        (ids,) = await self._job({"op": "chat", "messages": messages, "max_chars": max_chars,
                                  "max_tokens": max_tokens})
        return ids

    async def encode(self, texts: list[str], max_chars: int, max_tokens: int | None = None) -> list[list[int]]:
        """Token ids of each text, with the tokenizer's special tokens (as HF does by default)."""
        return await self._job({"op": "encode", "texts": texts, "max_chars": max_chars, "max_tokens": max_tokens})

    async def _job(self, job: dict) -> list[list[int]]:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:
            while self._idle and not self._idle[-1].alive:
                self._idle.pop()
            self._killed = {w for w in self._killed if w.alive}
            worker = self._idle.pop() if self._idle else await _Worker.start(self.package_dir, self.memory_bytes)
            self._busy.add(worker)
            reply = None
            try:
                reply = await asyncio.wait_for(worker.ask(job), self.timeout_s)
            except asyncio.TimeoutError:
                raise RenderError("timeout", f"took longer than the server's {self.timeout_s:g} s limit") from None
            except (asyncio.IncompleteReadError, ConnectionError, ValueError):
                raise RenderError("failed", "the render worker exited mid-job") from None
            finally:
                self._busy.discard(worker)
                if reply is not None and worker.alive and reply.get("kind") != "memory":
                    self._idle.append(worker)
                else:  # timed out, cancelled, out of memory or broken: a fresh worker next time
                    worker.kill()
                    self._killed.add(worker)
        if not reply.get("ok"):
            raise RenderError(str(reply.get("kind", "failed")), str(reply.get("message", "the worker failed")),
                              reply.get("chars"), reply.get("tokens"))
        try:
            return [_unpack_ids(ids) for ids in reply["ids"]]
        except (KeyError, TypeError, ValueError):
            raise RenderError("failed", "the render worker answered nonsense") from None

    def kill(self) -> None:
        """Kill every worker now, without waiting (a finalizer's last resort)."""
        for w in [*self._idle, *self._busy]:
            w.kill()
        self._idle.clear()

    async def close(self) -> None:
        """Kill every worker (idle or busy) and wait for them."""
        workers = [*self._idle, *self._busy, *self._killed]
        self._idle.clear()
        self._killed.clear()
        for w in workers:
            w.kill()
        await asyncio.gather(*(w.proc.wait() for w in workers), return_exceptions=True)


# ---- the worker's side ----------------------------------------------------------------
def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _run(package, job: dict) -> dict:
    from tinyserve_trt.runtime.model_package import PackageError

    max_chars, max_tokens = job["max_chars"], job.get("max_tokens")
    try:
        if job["op"] == "chat":
            try:
                texts, special = [package.apply_chat_template(job["messages"])], False
            except (PackageError, MemoryError):
                raise
            except Exception as e:  # the template's raise_exception, a render error, a RecursionError
                detail = str(e) if type(e).__module__.startswith("jinja2") else type(e).__name__
                return {"ok": False, "kind": "template", "message": _one_line(detail)}
        else:
            texts, special = job["texts"], True
        for text in texts:
            if len(text) > max_chars:
                return {"ok": False, "kind": "too_long", "chars": len(text),
                        "message": f"{len(text)} characters, more than {max_chars}"}
        try:
            ids = [package.encode(t, add_special_tokens=special) for t in texts]
        except (PackageError, MemoryError):
            raise
        except Exception as e:  # a lone surrogate, a tokenizer's own error
            return {"ok": False, "kind": "tokenizer", "message": f"the tokenizer failed ({type(e).__name__})"}
        longest = max(map(len, ids), default=0)
        if max_tokens is not None and longest >= max_tokens:
            return {"ok": False, "kind": "too_long", "tokens": longest,
                    "message": f"{longest} tokens, {max_tokens} or more"}
        return {"ok": True, "ids": [_pack_ids(i) for i in ids]}
    except MemoryError:
        return {"ok": False, "kind": "memory", "message": "went past the server's memory limit"}
    except PackageError as e:
        return {"ok": False, "kind": "package", "message": _one_line(e)}


def _limit_memory(extra_bytes: int) -> None:
    """RLIMIT_DATA = the data this process maps now + ``extra_bytes`` (Linux counts heap and
    private writable mappings there); elsewhere only the time limit holds."""
    try:
        import resource

        with open("/proc/self/status") as f:
            used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
        limit = used + extra_bytes
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    except (ImportError, OSError, StopIteration, ValueError) as e:
        print(f"tinyserve render worker: no memory limit ({type(e).__name__})", file=sys.stderr, flush=True)


def _worker(package_dir: str, memory_bytes: int) -> int:
    out = os.fdopen(os.dup(1), "wb")  # the protocol's channel; stray prints go to stderr
    os.dup2(2, 1)
    inp = sys.stdin.buffer

    def send(obj) -> None:
        out.write(_frame(obj))
        out.flush()

    from tinyserve_trt.runtime.model_package import ModelPackage, PackageError

    package = ModelPackage.load(package_dir)
    try:  # load now what every job needs, so its cost is not charged to the first job's limits
        package.tokenizer
    except PackageError:
        pass
    if package.chat_template is not None:
        try:
            import jinja2.sandbox  # noqa: F401
        except ImportError:
            pass
    _limit_memory(memory_bytes)
    send({"ready": True})
    while True:
        header = inp.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return 0  # the server closed our stdin: it is gone or done
        (size,) = _HEADER.unpack(header)
        try:
            reply = _run(package, json.loads(inp.read(size)))
        except MemoryError:
            reply = {"ok": False, "kind": "memory", "message": "went past the server's memory limit"}
        send(reply)
        if reply.get("kind") == "memory":
            return 0  # its heap may be fragmented past use: the server starts a fresh worker


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], int(sys.argv[2])))
