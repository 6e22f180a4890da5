"""llama.cpp's side of the peer protocol: run as a script by the llama-cpp-python venv's python.

Imports only the standard library, numpy and ``llama_cpp`` (nothing of tinyserve: the venv has
none of it). Speaks JSON lines: the first line on stdin configures the model
``{"model", "n_ctx", "threads", "n_batch"}`` and is answered ``{"ok": true, "version", "n_vocab",
"load_s"}``; then each request gets one reply:

  {"op": "eval", "start": S, "ids": [...]}           the cache is cut to its first S tokens, then
      -> {"ok", "seconds", "next", "peak_rss"}       ``Llama.eval(ids)`` (timed); next = greedy token
  {"op": "steps", "start": S, "token": T, "steps": K} cut to S tokens, then K times: eval([T]) and
      -> {"ok", "seconds": [K], "tokens": [K]}       T = its greedy token (each timed, argmax included)
  {"op": "quit"}                                      exit 0

A failure is answered ``{"error": "<one line>"}`` (a bad first line ends the child, exit 2). The
protocol owns the real stdout; llama.cpp's own prints go to stderr, so they cannot corrupt it.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Session:
    def __init__(self, config: dict):
        import llama_cpp
        import numpy as np

        self.np, self.lib = np, llama_cpp
        t0 = time.perf_counter()
        threads = int(config["threads"])
        self.llm = llama_cpp.Llama(model_path=str(config["model"]), n_ctx=int(config["n_ctx"]), n_threads=threads,
                                   n_threads_batch=threads, n_batch=int(config.get("n_batch", 512)),
                                   logits_all=False, verbose=False)
        self.load_s = time.perf_counter() - t0
        self.n_vocab = int(self.llm.n_vocab())
        self.version = getattr(llama_cpp, "__version__", "unknown")

    def _greedy(self) -> int:
        logits = self.np.ctypeslib.as_array(self.lib.llama_get_logits(self.llm.ctx), shape=(self.n_vocab,))
        return int(logits.argmax())

    def _cut(self, start: int) -> None:
        if not 0 <= start <= self.llm.n_tokens:
            raise ValueError(f"start {start} is outside the {self.llm.n_tokens} cached tokens")
        self.llm.n_tokens = start  # eval() removes the cache past n_tokens before it decodes

    def eval(self, start: int, ids: list) -> dict:
        self._cut(start)
        t0 = time.perf_counter()
        self.llm.eval(ids)
        seconds = time.perf_counter() - t0
        return dict(ok=True, seconds=seconds, next=self._greedy(), peak_rss=_peak_rss())

    def steps(self, start: int, token: int, steps: int) -> dict:
        self._cut(start)
        seconds, tokens = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.llm.eval([token])
            token = self._greedy()
            seconds.append(time.perf_counter() - t0)
            tokens.append(token)
        return dict(ok=True, seconds=seconds, tokens=tokens)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def main() -> int:
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # C-level prints of llama.cpp land on stderr

    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        session = Session(json.loads(sys.stdin.readline()))
    except Exception as e:  # no llama_cpp, a bad GGUF, a bad config line
        reply(dict(error=_one_line(e)))
        return 2
    reply(dict(ok=True, version=session.version, n_vocab=session.n_vocab, load_s=session.load_s))
    for line in sys.stdin:
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "quit":
                return 0
            if op == "eval":
                reply(session.eval(int(req["start"]), [int(i) for i in req["ids"]]))
            elif op == "steps":
                reply(session.steps(int(req["start"]), int(req["token"]), int(req["steps"])))
            else:
                reply(dict(error=f"unknown op {op!r}"))
        except Exception as e:
            reply(dict(error=_one_line(e)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
