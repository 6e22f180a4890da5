"""OrtBackend: the rewritten model in ONNX Runtime, reading the page pool in place.

The page pools and key_min/key_max of every layer are bound once, as OrtValues
over the pool's numpy arrays (CPU memory shared, not copied), so a step feeds
only the small per-step arrays (ids, positions, page table, lengths, budget,
logits index). ``PagePool.write_batch`` updates the same arrays after the
step, and the next run sees them. With the CUDA EP the pools stay in host
memory and ORT copies them each step: correct but slow - the TensorRT backend
is the GPU path.
"""

from __future__ import annotations

import numpy as np

from tinyserve_trt.runtime.backends.base import Backend, StepOutput
from tinyserve_trt.runtime.batch import ScheduledBatch

_NP_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
             "tensor(float16)": np.float16}


def default_providers() -> list[str]:
    """CUDA EP first when onnxruntime-gpu is installed and sees a GPU, CPU EP always."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    providers = ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" in available:
        try:
            if ort.get_device() == "GPU":
                providers.insert(0, "CUDAExecutionProvider")
        except Exception:  # no driver: stay on CPU
            pass
    return providers


class OrtBackend(Backend):
    """One InferenceSession over ``package.model_path``.

    threads:   intra-op threads (None: ORT's default, all cores).
    providers: execution providers, default :func:`default_providers`.
    selected_pages: fetch each layer's ``selected_pages`` output (stats).
    """

    name = "ort"

    def __init__(self, package, pool, threads: int | None = None, providers: list[str] | None = None,
                 selected_pages: bool = True):
        import onnxruntime as ort

        if np.dtype(package.dtype) != pool.k_pages(0).dtype:
            raise ValueError(f"page pool dtype {pool.k_pages(0).dtype} does not match the model's {package.dtype}")
        if (pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.page_size) != (
                package.num_layers, package.num_kv_heads, package.head_dim, package.page_size):
            raise ValueError("page pool geometry (layers, kv heads, head dim, page size) does not match the package")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a positive int, got {threads!r}")
        self.package, self.pool = package, pool
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if threads is not None:
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
        providers = providers or default_providers()
        # The exporter's ORT-optimized copy is CPU-EP specific; other providers start from the portable model.
        model = package.ort_model_path(ort.__version__) if providers == ["CPUExecutionProvider"] else \
            package.model_path
        try:
            self.session = ort.InferenceSession(str(model), so, providers=providers)
        except Exception as e:
            if providers == ["CPUExecutionProvider"]:
                raise
            # CUDA EP can fail on model-local functions before inlining (ORT #27873): fall back.
            import warnings

            warnings.warn(f"ORT providers {providers} failed ({str(e).splitlines()[0][:120]}); using CPU")
            self.session = ort.InferenceSession(str(package.model_path), so, providers=["CPUExecutionProvider"])
        self._types = {i.name: _NP_TYPES.get(i.type, np.int64) for i in self.session.get_inputs()}
        self._inputs = package.inputs
        self._binding = self.session.io_binding()
        self._pool_values = []  # keep the OrtValues (and through them the arrays) alive
        for layer, names in enumerate(package.layers):
            for role, array in (("key_cache", pool.k_pages(layer)), ("value_cache", pool.v_pages(layer)),
                                ("key_min", pool.key_min(layer)), ("key_max", pool.key_max(layer))):
                if not array.flags.c_contiguous:
                    raise ValueError(f"pool storage for {role} of layer {layer} is not contiguous")
                value = ort.OrtValue.ortvalue_from_numpy(array)  # shares the numpy buffer on CPU
                self._binding.bind_ortvalue_input(names[role], value)
                self._pool_values.append(value)
        self._fed: dict[str, np.ndarray] = {}
        self._outputs = [package.logits]
        for names in package.layers:
            self._outputs += [names["new_key"], names["new_value"]]
        self._want_selected = selected_pages and all("selected_pages" in n for n in package.layers)
        if self._want_selected:
            self._outputs += [n["selected_pages"] for n in package.layers]

    def _feed(self, role: str, array: np.ndarray) -> None:
        name = self._inputs[role]
        array = np.ascontiguousarray(array, self._types[name])
        self._fed[role] = array  # the binding may point at this buffer: keep it alive until the run
        self._binding.bind_cpu_input(name, array)

    def run(self, batch: ScheduledBatch) -> StepOutput:
        n_layers = self.package.num_layers
        if len(batch) == 0:
            empty = [np.zeros((0, self.pool.num_kv_heads, 1), bool)] * n_layers if self._want_selected else None
            return StepOutput(np.zeros((0, self.package.vocab_size), np.float32), empty)
        self._feed("input_ids", batch.input_ids)
        if "position_ids" in self._inputs:
            self._feed("position_ids", batch.positions)
        self._feed("page_table", batch.page_table)
        self._feed("past_lens", batch.past_lens)
        self._feed("token_budget", batch.token_budget)
        last = batch.num_new_tokens.astype(np.int64) - 1
        if "logits_index" in self._inputs:
            self._feed("logits_index", last)
        # Rebind outputs every step: a bound output keeps its first shape otherwise.
        self._binding.clear_binding_outputs()
        for name in self._outputs:
            self._binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(self._binding)
        outs = self._binding.copy_outputs_to_cpu()
        logits = outs[0]
        logits = logits[:, 0] if "logits_index" in self._inputs else logits[np.arange(len(batch)), last]
        for layer in range(n_layers):
            self.pool.write_batch(layer, batch.slot_mapping, outs[1 + 2 * layer], outs[2 + 2 * layer])
        selected = outs[1 + 2 * n_layers:] if self._want_selected else None
        return StepOutput(np.asarray(logits, np.float32), selected)

    def close(self) -> None:
        self._binding = None
        self._pool_values = []
        self.session = None
