"""DeviceBinding: an ONNX Runtime session on a GPU EP reading KV pages that live on the GPU.

The pools are ``DevicePages`` (torch tensors on ``cuda:<device_id>``) attached to
the page pool, and bound once to the session's IOBinding by device pointer
(``bind_input(name, 'cuda', device_id, element_type, shape, buffer_ptr)``), so ORT
reads them in place. A step:

  host -> device  token ids, positions, the physical page table, past lengths,
                  budgets, logits index, and the slots the new tokens go to
                  (all O(batch x new tokens) or O(batch x page-table width))
  run             outputs bound to device buffers made for this step's shapes
  on the device   each layer's new K/V written into its pages and the touched
                  pages' key_min/key_max refreshed: the ``qsa_append_kv`` kernel when
                  the cuda library is built, torch indexing otherwise
  device -> host  the last-token logits (float32), and the op's selected pages
                  when the caller asked for them (the tier policy needs them)

Every upload and download goes through the backend's ``TransferCounter``; the
pools never cross. ``run_with_iobinding`` synchronizes ORT's stream before it
returns, and torch's stream is synchronized before each run, so the page writes of
one step are visible to the next. torch is imported by the constructor.
"""

from __future__ import annotations

import numpy as np

from tinyserve_trt.runtime.backends.base import StepOutput
from tinyserve_trt.runtime.backends.device_pages import DevicePages
from tinyserve_trt.runtime.batch import ScheduledBatch

_ORT_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
              "tensor(float16)": np.float16, "tensor(bool)": np.bool_, "tensor(int8)": np.int8,
              "tensor(uint8)": np.uint8}


def kernel_writer_available() -> bool:
    """Whether the cuda library (``qsa_append_kv``) is built and loads."""
    try:
        from tinyserve_trt.cuda import library

        library.load()
        return True
    except (OSError, ImportError):
        return False


class DeviceBinding:
    """Pages on ``cuda:device_id`` bound to ``session``; :meth:`run` is one step.

    counter:      the backend's ``TransferCounter`` (every host <-> device copy).
    want_selected: download each layer's ``selected_pages``.
    use_kernel:   write new K/V with ``qsa_append_kv`` (None: when the cuda library loads).
    """

    def __init__(self, package, pool, session, counter, device_id: int = 0, want_selected: bool = False,
                 use_kernel: bool | None = None):
        import torch

        self._torch, self.package, self.pool, self.session, self.counter = torch, package, pool, session, counter
        self.device_id = device_id
        self.device = torch.device("cuda", device_id)
        dtype = torch.float16 if package.dtype == "float16" else torch.float32
        self.pages = DevicePages(pool, dtype, self.device, package.cold_tier)
        pool.attach_storage(self.pages)
        self.in_types = {i.name: _ORT_TYPES.get(i.type, np.int64) for i in session.get_inputs()}
        self.out_types = {o.name: _ORT_TYPES.get(o.type, np.float32) for o in session.get_outputs()}
        self.binding = session.io_binding()
        self.want_selected = want_selected
        self.use_kernel = kernel_writer_available() if use_kernel is None else use_kernel
        self._bound: dict[str, int] = {}
        self._bind_pages()

    def _bind(self, name: str, tensor, np_type, output: bool = False) -> None:
        bind = self.binding.bind_output if output else self.binding.bind_input
        bind(name, "cuda", self.device_id, np_type, tuple(tensor.shape), tensor.data_ptr())

    def _bind_pages(self) -> None:
        """Every layer's cache inputs by device pointer (once: DevicePages never reallocates)."""
        for names, tensors in zip(self.package.layers, self.pages.layers):
            for role in self.pages.roles:
                name, t = names.get(role), tensors[role]
                if name is None or self._bound.get(name) == t.data_ptr():
                    continue
                self._bind(name, t, self.in_types[name])
                self._bound[name] = t.data_ptr()

    def _upload_inputs(self, batch: ScheduledBatch, table: np.ndarray, last: np.ndarray) -> dict:
        inputs, torch = self.package.inputs, self._torch
        by_role = dict(input_ids=batch.input_ids, position_ids=batch.positions, page_table=table,
                       past_lens=batch.past_lens, token_budget=batch.token_budget, logits_index=last)
        uploaded = {}
        for role, array in by_role.items():
            if role in inputs:
                name = inputs[role]
                t = uploaded[role] = self.counter.upload(torch, role, array, self.device, self.in_types[name])
                self._bind(name, t, self.in_types[name])
        return uploaded

    def _bind_outputs(self, batch: ScheduledBatch) -> dict:
        """Device buffers for this step's outputs, bound by pointer (shapes from the batch)."""
        torch = self._torch
        b, s = batch.input_ids.shape
        width = batch.page_table.shape[1]
        h, d = self.package.num_kv_heads, self.package.head_dim
        logits = self.package.logits
        shapes = {logits: (b, 1 if "logits_index" in self.package.inputs else s, self.package.vocab_size)}
        for names in self.package.layers:
            shapes[names["new_key"]] = shapes[names["new_value"]] = (b, h, s, d)
            if self.want_selected and "selected_pages" in names:
                shapes[names["selected_pages"]] = (b, h, width)
        self.binding.clear_binding_outputs()
        outputs = {}
        for name, shape in shapes.items():
            np_type = self.out_types.get(name, np.float32)
            outputs[name] = torch.empty(shape, dtype=getattr(torch, np.dtype(np_type).name), device=self.device)
            self._bind(name, outputs[name], np_type, output=True)
        return outputs

    def run(self, batch: ScheduledBatch) -> StepOutput:
        torch = self._torch
        self.pages.flush()  # queued demotions, before their hot slots are reused
        self._bind_pages()
        table = self.pool.physical_table(batch.page_table)
        last = batch.num_new_tokens.astype(np.int64) - 1
        uploaded = self._upload_inputs(batch, table, last)
        outputs = self._bind_outputs(batch)
        if torch.cuda.is_available():  # uploads and last step's page writes done before ORT reads them
            torch.cuda.current_stream(self.device).synchronize()
        self.session.run_with_iobinding(self.binding)
        self._write_pages(batch, outputs, uploaded)
        logits = outputs[self.package.logits]
        if "logits_index" in self.package.inputs:
            logits = logits[:, 0]
        else:
            rows = self.counter.upload(torch, "logits_rows", last, self.device)
            logits = logits[torch.arange(len(batch), device=self.device), rows]
        host_logits = self.counter.download("logits", logits.float())  # synchronizes the stream
        if getattr(self, "_appender", None) is not None:
            self._appender.check("ORT backend: qsa_append_kv")
        selected = None
        if self.want_selected:
            selected = [self.counter.download(f"selected_pages.{i}", outputs[n["selected_pages"]].bool())
                        for i, n in enumerate(self.package.layers)]
        return StepOutput(host_logits, selected)

    # ---- new K/V into the pages, on the device -------------------------------
    def _write_pages(self, batch: ScheduledBatch, outputs: dict, uploaded: dict) -> None:
        if self.use_kernel:
            self._append_kernel(batch, outputs, uploaded)
            self.pool.note_device_writes(batch.slot_mapping)
        else:
            self._append_torch(batch, outputs)

    def _append_kernel(self, batch: ScheduledBatch, outputs: dict, uploaded: dict) -> None:
        """``qsa_append_kv`` per layer on the current stream, as the TensorRT backend does."""
        from tinyserve_trt.runtime.backends.device_append import DeviceAppender

        if getattr(self, "_appender", None) is None:
            self._appender = DeviceAppender(self._torch, self.device, self.pages, self.package.layers)
        stream = int(self._torch.cuda.current_stream(self.device).cuda_stream or 0)
        self._appender.enqueue(batch, outputs, uploaded["page_table"].int(), uploaded["past_lens"].int(), stream)

    def _append_torch(self, batch: ScheduledBatch, outputs: dict) -> None:
        """The same writes with torch indexing: the token slots and the touched pages'
        valid counts are uploaded once (O(new tokens)), then every layer scatters its
        new K/V and refreshes min/max of the touched pages on the device."""
        torch, ps = self._torch, self.pool.page_size
        slot_mapping = np.asarray(batch.slot_mapping, np.int64)
        keep = np.flatnonzero(slot_mapping.reshape(-1) >= 0)
        if not keep.size:
            return
        self.pool.note_device_writes(slot_mapping)  # checks the pages; valid counts for min/max
        slots = slot_mapping.reshape(-1)[keep]
        phys = self.pool.physical_table(slots // ps).astype(np.int64)
        upages = np.unique(phys)
        valid = self.pool.num_valid(0)[upages].astype(np.int64)
        where = self.counter.upload(torch, "write_slots", np.stack([keep, phys, slots % ps]), self.device)
        touched = self.counter.upload(torch, "touched_pages", np.stack([upages, valid]), self.device)
        tok, page, off = where
        b, h, s, d = outputs[self.package.layers[0]["new_key"]].shape
        for names, t in zip(self.package.layers, self.pages.layers):
            for out, role in ((names["new_key"], "key_cache"), (names["new_value"], "value_cache")):
                new = outputs[out].transpose(1, 2).reshape(b * s, h, d)[tok]  # [tokens, Hkv, D]
                t[role][page, :, off] = new.to(t[role].dtype)
            self.pages._refresh_minmax(t, touched[0], t["key_cache"][touched[0]], touched[1])

    def close(self) -> None:
        self.binding = None
        self.pages = None
