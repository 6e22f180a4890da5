"""ORT GenAI's decode step where GenAI itself cannot prefill the batch: its graph run as GenAI runs it.

onnxruntime-genai 0.18 takes a batch > 1 prompt in one piece ("AppendTokens can only be called once
for batch_size > 1"), and its GroupQueryAttention then materialises [batch, heads, S, S] float32
scores: 224 GiB for 4 x 32K of Qwen's 14 heads. Its decode step is what the benchmark compares,
so :class:`GenaiGraphTimer` runs the GenAI model's own ``model.onnx`` in an ONNX Runtime session
the way GenAI's generator does (``genai_config.json``: ``past_present_share_buffer``): every
layer's past and present key / value bound to one ``[batch, kv_heads, max_length, head_dim]``
buffer, ``attention_mask`` of ones over the tokens so far, GroupQueryAttention writing each new
token in place. The shared prompt prefix is prefilled once at batch 1 in pieces (as GenAI does at
batch 1) into row 0, copied to the other rows (the rows share it, ``bench_decode.prompts``), then
each row's own last token; a timed step is one ``run_with_iobinding`` plus the greedy argmax.
What it leaves out is GenAI's generator bookkeeping around that call.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np


class GenaiGraphTimer:
    """GenAI's graph over ``rows`` (token id lists sharing all but their last token), prefilled;
    :meth:`time` times decode steps from the prompt, like ``bench_decode.GenaiTimer.time``."""

    def __init__(self, model_dir: Path, rows: list[list[int]], max_new: int, threads: int, chunk: int = 1024):
        import onnxruntime as ort

        model_dir = Path(model_dir)
        config = json.loads((model_dir / "genai_config.json").read_text())
        decoder = config["model"]["decoder"]
        if not config.get("search", {}).get("past_present_share_buffer", False):
            raise ValueError(f"{model_dir}: genai_config.json does not share past and present buffers")
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        self.ort, self.rows = ort, np.asarray(rows, np.int64)
        self.session = ort.InferenceSession(str(model_dir / decoder["filename"]), so, providers=["CPUExecutionProvider"])
        names = [i.name for i in self.session.get_inputs()]
        self.layers = sorted({int(n.split(".")[1]) for n in names if n.startswith("past_key_values.")})
        past = next(i for i in self.session.get_inputs() if i.name.startswith("past_key_values."))
        kv_heads, head_dim = past.shape[1], decoder["head_size"]
        self.vocab = config["model"]["vocab_size"]
        B, n = self.rows.shape
        self.max_length = n + max_new + 8
        self.cache = {(i, kind): np.zeros((B, kv_heads, self.max_length, head_dim), np.float32)
                      for i in self.layers for kind in ("key", "value")}
        self._prefill(self.rows[0, :-1], chunk)
        for buf in self.cache.values():  # the rows share the prefix: row 0's cache, copied
            buf[1:, :, :n - 1] = buf[0:1, :, :n - 1]

    def _run(self, ids: np.ndarray, past: int, rows: slice) -> np.ndarray:
        """One call: ``ids`` [b, s] after ``past`` tokens, over the cache rows ``rows``; the logits of the last."""
        b, s = ids.shape
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(ids, np.int64))
        binding.bind_cpu_input("attention_mask", np.ones((b, past + s), np.int64))
        for (layer, kind), buf in self.cache.items():
            value = self.ort.OrtValue.ortvalue_from_numpy(buf[rows])  # shared: GenAI's in-place cache
            binding.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", value)
            binding.bind_ortvalue_output(f"present.{layer}.{kind}", value)
        logits = np.empty((b, s, self.vocab), np.float32)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self.session.run_with_iobinding(binding)
        return logits[:, -1]

    def _prefill(self, ids: np.ndarray, chunk: int) -> None:
        for start in range(0, len(ids), chunk):
            self._run(ids[None, start:start + chunk], start, slice(0, 1))

    def time(self, steps: int) -> float:
        """Median seconds per decode step of the whole batch over ``steps`` steps; each call starts
        again from the prompt (the cache positions after it are overwritten)."""
        B, n = self.rows.shape
        tokens = self._run(self.rows[:, -1:], n - 1, slice(0, B)).argmax(-1)[:, None]
        times = []
        for step in range(steps):
            t0 = time.perf_counter()
            tokens = self._run(tokens, n + step, slice(0, B)).argmax(-1)[:, None]
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
