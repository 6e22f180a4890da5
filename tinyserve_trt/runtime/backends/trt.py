"""TrtBackend: a TensorRT engine with the QueryAwareSparseAttention plugin.

The package must hold ``model.plan`` (``tinyserve-export --backend trt``).
Page pools live on the GPU as torch CUDA tensors, one set per layer, bound by
address to the engine's ``key_cache.{i}`` ... inputs, so a step moves only
the small per-step arrays. New K/V are written into their pages by the
``qsa_append_kv`` kernel (which also refreshes key_min/key_max) on the same
stream; copy-on-write copies reach the device through the pool's copy
listener. The host PagePool keeps the page bookkeeping (ids, refcounts,
prefix cache); its own K/V arrays are not read by this backend.

Every missing piece is a one-line RuntimeError: no tensorrt, no plugin
library, no GPU, no engine in the package, an engine built for another
TensorRT version or GPU. Written against the TensorRT 10 Python API
(``execute_async_v3``, ``set_input_shape``, ``set_tensor_address``); it
cannot run on our CI machines (no GPU, no TensorRT) - see plugins/README.md.
Not done yet: capturing the decode step in a CUDA graph.
"""

from __future__ import annotations

import numpy as np

from tinyserve_trt.runtime.backends.base import Backend, StepOutput
from tinyserve_trt.runtime.batch import ScheduledBatch


def _load_tensorrt():
    from tinyserve_trt.export.errors import UnsupportedError
    from tinyserve_trt.export.trt_build import require_tensorrt

    try:
        return require_tensorrt()
    except UnsupportedError as e:
        raise RuntimeError(str(e)) from None


class TrtBackend(Backend):
    name = "trt"

    def __init__(self, package, pool, device: int = 0, **_ignored):
        trt = _load_tensorrt()
        import torch

        engine_info = package.manifest.get("engine")
        if not engine_info or not (package.path / engine_info["file"]).is_file():
            raise RuntimeError(f"{package.path}: no TensorRT engine in the package; export it with "
                               "tinyserve-export --backend trt on this machine")
        self._torch, self.package, self.pool = torch, package, pool
        self.device = torch.device("cuda", device)
        logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(logger)
        self.engine = runtime.deserialize_cuda_engine((package.path / engine_info["file"]).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"{package.path / engine_info['file']}: TensorRT could not load the engine (built for "
                               "another TensorRT version or GPU?); rebuild it with tinyserve-export --backend trt")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream(self.device)
        self.max_batch, self.max_pages = engine_info["max_batch"], engine_info["max_pages"]
        dtype = torch.float16 if package.dtype == "float16" else torch.float32
        n, h, ps, d = pool.num_pages, pool.num_kv_heads, pool.page_size, pool.head_dim
        self.pages = []  # per layer (k, v, key_min, key_max) on the device
        for names in package.layers:
            tensors = (torch.zeros((n, h, ps, d), dtype=dtype, device=self.device),
                       torch.zeros((n, h, ps, d), dtype=dtype, device=self.device),
                       torch.zeros((n, h, d), dtype=dtype, device=self.device),
                       torch.zeros((n, h, d), dtype=dtype, device=self.device))
            for role, t in zip(("key_cache", "value_cache", "key_min", "key_max"), tensors):
                self.context.set_tensor_address(names[role], t.data_ptr())
            self.pages.append(tensors)
        pool.add_copy_listener(self._copy_page)

    def _copy_page(self, src: int, dst: int) -> None:
        with self._torch.cuda.stream(self.stream):
            for tensors in self.pages:
                for t in tensors:
                    t[dst].copy_(t[src])

    def _bind_input(self, name: str, array: np.ndarray, keep: list) -> None:
        trt_dtype = self.engine.get_tensor_dtype(name)
        np_dtype = {"INT32": np.int32, "INT64": np.int64}.get(trt_dtype.name, np.int64)
        t = self._torch.from_numpy(np.ascontiguousarray(array, np_dtype)).to(self.device, non_blocking=True)
        keep.append(t)
        self.context.set_input_shape(name, tuple(t.shape))
        self.context.set_tensor_address(name, t.data_ptr())

    def run(self, batch: ScheduledBatch) -> StepOutput:
        torch = self._torch
        if len(batch) > self.max_batch or batch.page_table.shape[1] > self.max_pages:
            raise RuntimeError(f"batch {len(batch)} x {batch.page_table.shape[1]} pages is outside the engine's "
                               f"profile ({self.max_batch} x {self.max_pages}); lower max_batch or re-export")
        keep: list = []
        ins = self.package.inputs
        with torch.cuda.stream(self.stream):
            self._bind_input(ins["input_ids"], batch.input_ids, keep)
            if "position_ids" in ins:
                self._bind_input(ins["position_ids"], batch.positions, keep)
            for role, array in (("page_table", batch.page_table), ("past_lens", batch.past_lens),
                                ("token_budget", batch.token_budget)):
                self._bind_input(ins[role], array, keep)
            if "logits_index" in ins:
                self._bind_input(ins["logits_index"], batch.num_new_tokens.astype(np.int64) - 1, keep)
            for names, tensors in zip(self.package.layers, self.pages):
                for role, t in zip(("key_cache", "value_cache", "key_min", "key_max"), tensors):
                    self.context.set_input_shape(names[role], tuple(t.shape))
            outputs = {}
            for i in range(self.engine.num_io_tensors):
                name = self.engine.get_tensor_name(i)
                if self.engine.get_tensor_mode(name).name != "OUTPUT":
                    continue
                shape = tuple(self.context.get_tensor_shape(name))
                dt = {"FLOAT": torch.float32, "HALF": torch.float16, "INT32": torch.int32,
                      "BOOL": torch.bool}[self.engine.get_tensor_dtype(name).name]
                outputs[name] = torch.empty(shape, dtype=dt, device=self.device)
                self.context.set_tensor_address(name, outputs[name].data_ptr())
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log)")
            self._append(batch, outputs)
            logits = outputs[self.package.logits]
            logits = logits[:, 0] if "logits_index" in ins else logits[torch.arange(len(batch)),
                                                                       torch.from_numpy(batch.num_new_tokens - 1)]
            selected = [outputs[n["selected_pages"]].bool().cpu().numpy() for n in self.package.layers
                        if n.get("selected_pages") in outputs] or None
            logits = logits.float().cpu().numpy()
        self.stream.synchronize()
        return StepOutput(logits, selected)

    def _append(self, batch: ScheduledBatch, outputs: dict) -> None:
        """New K/V into their pages (+ metadata). Rows with fewer new tokens than the
        batch's width (right-padded prefill chunks) are written row by row, so no
        padding token lands in a page."""
        from tinyserve_trt.kernels.harness import append_kv_gpu

        torch = self._torch
        table = torch.from_numpy(np.ascontiguousarray(batch.page_table, np.int32)).to(self.device)
        past = torch.from_numpy(np.ascontiguousarray(batch.past_lens, np.int32)).to(self.device)
        width = batch.input_ids.shape[1]
        full = bool(np.all(batch.num_new_tokens == width))
        for layer, names in enumerate(self.package.layers):
            k, v = outputs[names["new_key"]], outputs[names["new_value"]]
            kc, vc, kmin, kmax = self.pages[layer]
            if full:
                append_kv_gpu(k, v, kc, vc, kmin, kmax, table, past)
                continue
            for row, count in enumerate(batch.num_new_tokens):
                if count > 0:
                    append_kv_gpu(k[row:row + 1, :, :count], v[row:row + 1, :, :count], kc, vc, kmin, kmax,
                                  table[row:row + 1], past[row:row + 1])

    def close(self) -> None:
        self.context = None
        self.engine = None
        self.pages = []
