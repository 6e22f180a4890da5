"""DeviceAppender: a step's new K/V into device pages with the ``qsa_append_kv`` kernel.

Shared by the backends whose pages live on the GPU (``trt``, and ``ort`` on the
CUDA / TensorRT EP). Stream-ordered and allocation-free apart from one int32
error word made once: no synchronisation, no host copy. The kernel also
refreshes key_min/key_max of the pages it writes. Bad page ids or a full page
table set the error word; :meth:`check` raises them once the stream has run.
"""

from __future__ import annotations

import numpy as np

from tinyserve_trt.cuda import library

POOL_ROLES = ("key_cache", "value_cache", "key_min", "key_max")


class DeviceAppender:
    """``pages``: a ``DevicePages`` (``.layers[i][role]`` torch tensors); ``layers``: the
    package's per-layer I/O names (``new_key`` / ``new_value`` outputs)."""

    def __init__(self, torch, device, pages, layers):
        self._torch, self.pages, self.layers = torch, pages, layers
        self.flags = torch.zeros(1, dtype=torch.int32, device=device)
        self.lib = library.load()

    def enqueue(self, batch, outputs: dict, page_table, past_lens, stream: int = 0) -> None:
        """Write ``batch``'s rows (``outputs[new_key/new_value][:len(batch)]``) into the pages of
        ``page_table`` / ``past_lens`` (int32 device tensors, physical page ids). Rows with fewer
        new tokens than the batch's width (right-padded prefill chunks) are written row by row,
        so no padding token lands in a page; a graph's padding rows are never written."""
        torch = self._torch
        self.flags.zero_()
        n, width = len(batch), batch.input_ids.shape[1]
        full = bool(np.all(batch.num_new_tokens == width))
        dtype = "float16" if self.pages.layers[0]["key_cache"].dtype == torch.float16 else "float32"

        def append(**tensors):
            tensors["error_flags"] = self.flags
            library.append_kv(self.lib, {k: tuple(t.shape) for k, t in tensors.items()},
                              {k: t.data_ptr() for k, t in tensors.items()}, dtype, stream)

        for layer, names in enumerate(self.layers):
            k, v = outputs[names["new_key"]][:n], outputs[names["new_value"]][:n]
            pools = {role: self.pages.layers[layer][role] for role in POOL_ROLES}
            if full:
                append(key=k.contiguous(), value=v.contiguous(), page_table=page_table, past_lens=past_lens,
                       **pools)
                continue
            for row, count in enumerate(batch.num_new_tokens):
                if count > 0:
                    append(key=k[row:row + 1, :, :count].contiguous(), value=v[row:row + 1, :, :count].contiguous(),
                           page_table=page_table[row:row + 1], past_lens=past_lens[row:row + 1], **pools)

    def check(self, where: str) -> None:
        """After the stream has run: raise what the append kernels flagged."""
        library.check_flags(int(self.flags[0]), where)
