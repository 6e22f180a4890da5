"""A stand-in for llama-cpp-python in tests: the calls ``tinyserve_dev/peers/llamacpp_child.py`` makes.

``Llama.eval`` logs each call (cached tokens before it, tokens given) as a JSON line to
``$FAKE_LLAMA_LOG`` when set, prints to stdout (the child must keep that off its protocol), and sets
the logits so the greedy next token is (last token + 1) mod ``n_vocab``. Loading a path that is no
file fails as llama.cpp's does.
"""

import ctypes
import json
import os

__version__ = "0.0.fake"
N_VOCAB = 10


class _Ctx:
    def __init__(self):
        self.logits = (ctypes.c_float * N_VOCAB)()


def llama_get_logits(ctx):
    return ctypes.cast(ctx.logits, ctypes.POINTER(ctypes.c_float))


class Llama:
    def __init__(self, model_path, n_ctx=512, n_threads=None, n_threads_batch=None, n_batch=512, logits_all=False,
                 verbose=True):
        if not os.path.isfile(model_path):
            raise ValueError(f"Failed to load model from file: {model_path}")
        self.n_ctx_, self.threads, self.n_tokens, self.ctx = n_ctx, (n_threads, n_threads_batch), 0, _Ctx()

    def n_vocab(self):
        return N_VOCAB

    def eval(self, tokens):
        if self.n_tokens + len(tokens) > self.n_ctx_:
            raise RuntimeError(f"llama_decode returned 1: {self.n_tokens + len(tokens)} tokens > n_ctx {self.n_ctx_}")
        if os.environ.get("FAKE_LLAMA_LOG"):
            with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
                f.write(json.dumps(dict(n_past=self.n_tokens, n=len(tokens), threads=self.threads)) + "\n")
        print("fake llama.cpp: noise on stdout")
        self.n_tokens += len(tokens)
        for i in range(N_VOCAB):
            self.ctx.logits[i] = 1.0 if i == (tokens[-1] + 1) % N_VOCAB else 0.0
