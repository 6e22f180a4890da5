"""TrtBackend: a TensorRT engine with the QueryAwareSparseAttention plugin.

The package must hold ``model.plan`` (``tinyserve-export --backend trt``).
Page pools live on the GPU (``DevicePages``: torch CUDA tensors, one set per
layer, in the pool's physical layout), bound by address to the engine's
``key_cache.{i}`` ... inputs, so a step moves only the small per-step arrays.
New K/V are written into their pages by the ``qsa_append_kv`` kernel (which
also refreshes key_min/key_max) on the same stream. The host PagePool keeps
the page bookkeeping (ids, refcounts, prefix cache, valid counts) and forwards
copy-on-write copies to the device (``PagePool.attach_storage``).

Cold tier (issues #6, #17): over a ``TieredPagePool`` the engine's cold inputs
(``key_cache_int8.{i}`` ...) are bound to device INT8 or packed INT4 pools (the
package's ``cold_format`` per layer - an int4 package's ``int8_layers`` are INT8 -, which
each node's plugin reads as a field), the page table is
the pool's physical table, and the pool's demotions quantize on the device,
batched per step (``DevicePages.flush``).

Two-level packages (issue #15): each sparse layer's ``key_sub_bounds.{i}`` is bound
to DevicePages' uint8 codes like the other pools; the pool re-encodes the codes of the
pages a step wrote after the append (``PagePool.note_device_writes``), on the host.

Decode steps (one new token per row) replay a CUDA graph: the batch is padded
to a bucket shape ``[B, W]`` (``graph_buckets.DecodeBuckets``) and each bucket,
on first use, gets its own execution context (TensorRT ties a captured graph to
the context, input shapes and tensor addresses it was captured with), static
input/output buffers bound once, one plain ``execute_async_v3`` after the shape
change, then a capture on the backend's non-default stream. A step copies its
padded arrays into the static inputs and replays; the K/V append stays outside
the graph (``library.append_kv``, enqueued on the same stream) and skips the padding rows. The
graph contexts share one activation buffer: they run one at a time on one
stream. Prefill steps run plainly. ``cuda_graphs=False`` (backend option) or
``EngineConfig.cuda_graphs=False`` turns graphs off; any capture failure (e.g. an
engine that cannot be captured) warns once and turns them off for good.

Every missing piece is a one-line RuntimeError: no tensorrt, no plugin
library, no GPU, no engine in the package, an engine built for another
TensorRT version or GPU. Written against the TensorRT 10 Python API
(``execute_async_v3``, ``set_input_shape``, ``set_tensor_address``); it
cannot run on our CI machines (no GPU, no TensorRT) - see plugins/README.md.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np

from tinyserve_trt.runtime.backends.base import Backend, StepOutput
from tinyserve_trt.runtime.backends.device_pages import DevicePages
from tinyserve_trt.runtime.backends.graph_buckets import DecodeBuckets, check_profile
from tinyserve_trt.runtime.backends.kernel_report import KernelReport
from tinyserve_trt.runtime.batch import ScheduledBatch



def _load_tensorrt(plugin_dir: str | None = None):
    from tinyserve_trt.cuda.plugin import require_tensorrt  # TensorRTUnavailable is a RuntimeError

    return require_tensorrt(plugin_dir)


class TrtBackend(Backend):
    name = "trt"
    reads_cold_pages = True

    def __init__(self, package, pool, device: int = 0, cuda_graphs: bool = True, plugin_dir: str | None = None,
                 **_ignored):
        trt = _load_tensorrt(plugin_dir)
        import torch

        engine_info = package.manifest.get("engine")
        if not engine_info or not (package.path / engine_info["file"]).is_file():
            raise RuntimeError(f"{package.path}: no TensorRT engine in the package; export it with "
                               "tinyserve-export --backend trt on this machine")
        self._trt, self._torch, self.package, self.pool = trt, torch, package, pool
        self._report = KernelReport("trt", "tensorrt", engine_info["file"], "tensorrt_plugin",
                                    library=_plugin_path(plugin_dir))
        self.device = torch.device("cuda", device)
        logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(logger)
        self.engine = runtime.deserialize_cuda_engine((package.path / engine_info["file"]).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"{package.path / engine_info['file']}: TensorRT could not load the engine (built for "
                               "another TensorRT version or GPU?); rebuild it with tinyserve-export --backend trt")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream(self.device)  # non-default: graphs are captured on it
        self.max_batch, self.max_pages = engine_info["max_batch"], engine_info["max_pages"]
        self.buckets = DecodeBuckets(self.max_batch, self.max_pages)
        dtype = torch.float16 if package.dtype == "float16" else torch.float32
        self.pages = DevicePages(pool, dtype, self.device, package.cold_tier, stream=self.stream)
        _check_pool_fits(engine_info, self.pages, package.path)
        self._bind_pages(self.context)
        self._graphs: dict[tuple[int, int], _DecodeGraph] | None = {} if cuda_graphs else None
        self._scratch = None  # activation memory of the graph contexts, made with the first one
        pool.attach_storage(self.pages)

    def kernel_report(self):
        return self._report

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (False once a capture failed)."""
        return self._graphs is not None

    def _bind_pages(self, context) -> None:
        """Every layer's pool tensors by address, under the package's name for each role it
        has (a two-level package's dense layers take no ``key_sub_bounds``)."""
        for names, tensors in zip(self.package.layers, self.pages.layers):
            for role in self.pages.roles:
                if role not in names:
                    continue
                t = tensors[role]
                context.set_input_shape(names[role], tuple(t.shape))
                context.set_tensor_address(names[role], t.data_ptr())

    def _feeds(self, input_ids, positions, page_table, past_lens, token_budget, logits_index) -> dict:
        """Engine input name -> array for the step inputs this package has."""
        by_role = dict(input_ids=input_ids, position_ids=positions, page_table=page_table, past_lens=past_lens,
                       token_budget=token_budget, logits_index=logits_index)
        return {self.package.inputs[role]: a for role, a in by_role.items() if role in self.package.inputs}

    def _np_dtype(self, name: str):
        return {"INT32": np.int32, "INT64": np.int64}.get(self.engine.get_tensor_dtype(name).name, np.int64)

    def _bind_outputs(self, context) -> dict:
        """Fresh output buffers at the context's current shapes, bound to it."""
        torch = self._torch
        outputs = {}
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            if self.engine.get_tensor_mode(name).name != "OUTPUT":
                continue
            dt = {"FLOAT": torch.float32, "HALF": torch.float16, "INT32": torch.int32,
                  "BOOL": torch.bool}[self.engine.get_tensor_dtype(name).name]
            outputs[name] = torch.empty(tuple(context.get_tensor_shape(name)), dtype=dt, device=self.device)
            context.set_tensor_address(name, outputs[name].data_ptr())
        return outputs

    def run(self, batch: ScheduledBatch) -> StepOutput:
        torch = self._torch
        check_profile(len(batch), batch.page_table.shape[1], self.max_batch, self.max_pages)
        batch = replace(batch, page_table=self.pool.physical_table(batch.page_table))  # handles -> slots
        keep: list = []
        with torch.cuda.stream(self.stream):
            self.pages.flush()  # the demotions of the last rebalance, before their hot slots are reused
            outputs = None
            if self._graphs is not None and len(batch) and batch.input_ids.shape[1] == 1:
                outputs = self._replay(batch)
            if outputs is None:
                outputs = self._execute(batch, keep)
            self._append(batch, outputs)
            self.pool.note_device_writes(batch.slot_mapping)
            n, width = len(batch), batch.page_table.shape[1]
            logits = outputs[self.package.logits][:n]  # a graph's outputs have padding rows after the real ones
            logits = logits[:, 0] if "logits_index" in self.package.inputs else logits[
                torch.arange(n), torch.from_numpy(batch.num_new_tokens - 1)]
            selected = [outputs[names["selected_pages"]][:n, :, :width].bool().cpu().numpy()
                        for names in self.package.layers if names.get("selected_pages") in outputs] or None
            logits = logits.float().cpu().numpy()
        self.stream.synchronize()
        self._check_append()
        return StepOutput(logits, selected)

    def _execute(self, batch: ScheduledBatch, keep: list) -> dict:
        """The step without a graph: inputs uploaded and bound at the batch's own shapes."""
        feeds = self._feeds(batch.input_ids, batch.positions, batch.page_table, batch.past_lens,
                            batch.token_budget, batch.num_new_tokens.astype(np.int64) - 1)
        for name, array in feeds.items():
            t = self._torch.from_numpy(np.ascontiguousarray(array, self._np_dtype(name)))
            t = t.to(self.device, non_blocking=True)
            keep.append(t)
            self.context.set_input_shape(name, tuple(t.shape))
            self.context.set_tensor_address(name, t.data_ptr())
        outputs = self._bind_outputs(self.context)
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log)")
        return outputs

    def _replay(self, batch: ScheduledBatch) -> dict | None:
        """The decode step through its bucket's graph (captured on first use); its static
        outputs, padding rows included. None after a capture failure (graphs are then off)."""
        padded = self.buckets.pad(batch)
        feeds = self._feeds(padded.input_ids, padded.positions, padded.page_table, padded.past_lens,
                            padded.token_budget, padded.logits_index)
        graph = self._graphs.get(padded.shape)
        if graph is None:
            try:
                graph = self._graphs[padded.shape] = _DecodeGraph(self, feeds)
            except Exception as e:  # e.g. cudaErrorStreamCaptureUnsupported, or execute_async_v3 failing
                warnings.warn(f"TensorRT backend: CUDA graph capture failed for decode bucket {padded.shape} "
                              f"({type(e).__name__}: {e}); decode steps run without graphs from now on",
                              RuntimeWarning, stacklevel=3)
                self._graphs, self._scratch = None, None
                return None
        graph.replay(feeds)
        return graph.outputs

    def _graph_context(self):
        """A context for one graph, on the activation buffer all graph contexts share."""
        torch, trt = self._torch, self._trt
        context = self.engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if context is None:
            raise RuntimeError("TensorRT could not create an execution context for a CUDA graph")
        if self._scratch is None:
            size = getattr(self.engine, "device_memory_size_v2", None) or self.engine.device_memory_size
            self._scratch = torch.empty(max(int(size), 1), dtype=torch.uint8, device=self.device)
        if hasattr(context, "set_device_memory"):  # TensorRT >= 10.1
            context.set_device_memory(self._scratch.data_ptr(), self._scratch.numel())
        else:
            context.device_memory = self._scratch.data_ptr()
        return context

    def _append(self, batch: ScheduledBatch, outputs: dict) -> None:
        """New K/V into their pages (+ metadata), enqueued on the backend's stream: no sync, no
        host copy; bad page ids / a full page table are raised after the step's sync."""
        from tinyserve_trt.runtime.backends.device_append import DeviceAppender

        torch = self._torch
        if getattr(self, "_appender", None) is None:
            self._appender = DeviceAppender(torch, self.device, self.pages, self.package.layers)
        table = torch.from_numpy(np.ascontiguousarray(batch.page_table, np.int32)).to(self.device)
        past = torch.from_numpy(np.ascontiguousarray(batch.past_lens, np.int32)).to(self.device)
        self._appender.enqueue(batch, outputs, table, past, int(self.stream.cuda_stream or 0))

    def _check_append(self) -> None:
        """After the stream has run: raise what the append kernels flagged."""
        if getattr(self, "_appender", None) is not None:
            self._appender.check("TensorRT backend: qsa_append_kv")

    def close(self) -> None:
        self._graphs = None  # graphs before the contexts they were captured from
        self._scratch = None
        self.context = None
        self.engine = None
        self.pages = None


def _plugin_path(plugin_dir: str | None) -> str | None:
    """The plugin library ``require_tensorrt`` loaded (None when a stand-in TensorRT loaded none)."""
    from tinyserve_trt.cuda.plugin import TensorRTUnavailable, plugin_library

    try:
        return str(plugin_library(plugin_dir))
    except TensorRTUnavailable:
        return None


def _check_pool_fits(engine_info: dict, pages: DevicePages, path) -> None:
    """One-line error when the pools exceed the page counts the engine's profile allows
    (packages from before the profile covered the pools have no limits recorded)."""
    for key, have in (("max_pool_pages", pages.num_hot), ("max_cold_pages", pages.num_cold)):
        limit = engine_info.get(key)
        if limit is not None and have > limit:
            raise RuntimeError(f"{path}: the page pool needs {have} {key[4:].replace('_', ' ')} but the engine "
                               f"was built for at most {limit}; lower EngineConfig.memory / max_batch / max_seq_len")


class _DecodeGraph:
    """One decode bucket ``[B, W]`` captured as a CUDA graph.

    Owns an execution context whose input shapes, tensor addresses (static inputs,
    the backend's page pools, static outputs) never change after capture, which is
    what a TensorRT graph requires. ``feeds`` (engine input name -> padded array)
    fixes the shapes and is what the warm-up and the capture compute.
    """

    def __init__(self, backend: TrtBackend, feeds: dict[str, np.ndarray]):
        torch, stream = backend._torch, backend.stream
        self._torch, self.stream = torch, stream
        self.context = context = backend._graph_context()
        self.inputs, self.host = {}, {}
        for name, array in feeds.items():
            host = torch.from_numpy(np.ascontiguousarray(array, backend._np_dtype(name))).pin_memory()
            self.host[name] = host  # pinned staging: the step's copy is asynchronous
            self.inputs[name] = host.to(backend.device)
            context.set_input_shape(name, tuple(host.shape))
            context.set_tensor_address(name, self.inputs[name].data_ptr())
        backend._bind_pages(context)
        self.outputs = backend._bind_outputs(context)
        with torch.cuda.stream(stream):
            # After a shape change TensorRT may defer work to the next enqueue; run once
            # outside the capture so the graph holds only the steady-state launches.
            if not context.execute_async_v3(stream.cuda_stream):
                raise RuntimeError("execute_async_v3 failed before capture (see the TensorRT log)")
        stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            ok = context.execute_async_v3(stream.cuda_stream)
        if not ok:
            raise RuntimeError("execute_async_v3 failed during capture (see the TensorRT log)")

    def replay(self, feeds: dict[str, np.ndarray]) -> None:
        """Copy ``feeds`` (same names and shapes as at capture) into the static inputs and
        replay on the backend's stream. The caller synchronizes the stream before the next
        replay (the pinned staging buffers are reused)."""
        with self._torch.cuda.stream(self.stream):
            for name, array in feeds.items():
                np.copyto(self.host[name].numpy(), array, casting="same_kind")
                self.inputs[name].copy_(self.host[name], non_blocking=True)
            self.graph.replay()
