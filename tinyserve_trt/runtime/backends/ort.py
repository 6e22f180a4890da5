"""OrtBackend: the rewritten model in ONNX Runtime, reading the page pool in place.

Two homes for the pages, chosen by the execution provider (``ort_providers``):

CPU EP: the page pools and key_min/key_max of every layer are bound once, as
OrtValues over the pool's numpy arrays (CPU memory shared, not copied), so a
step feeds only the small per-step arrays (ids, positions, page table, lengths,
budget, logits index), each copied into a buffer bound once and rebound only when
its shape changes; ORT writes the outputs into buffers bound the same way.
``PagePool.write_step`` updates the pool's arrays after the step (every layer in
one call), and the next run sees them. No device transfer (the counter says so).

CUDA / TensorRT EP: the pools live on the GPU (``ort_binding.DeviceBinding``:
``DevicePages`` bound by device pointer); only the per-step arrays go up and the
logits (and selected pages when asked) come down - see that module. The bytes
moved are counted in ``self.transfer`` (``Engine.stats()``'s ``transfer_*``).

Cold tier (issue #6): the op's inputs come from ``pool.cache_inputs(layer)``
by schema name (a ``TieredPagePool`` adds the INT8 pools and scales) and its
page table from ``pool.physical_table`` (handles -> hot/cold slots). Bindings
are checked against the pool's buffers every step and rebound where one
changed. A package with a cold tier over a plain ``PagePool`` gets a one-page
unused INT8 tier, so every page is read hot.
"""

from __future__ import annotations

import numpy as np

from tinyserve_trt.runtime.backends.base import Backend, StepOutput
from tinyserve_trt.runtime.batch import ScheduledBatch

_NP_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
             "tensor(float16)": np.float16, "tensor(bool)": np.bool_}


class OrtBackend(Backend):
    """One InferenceSession over ``package.model_path``.

    threads:   intra-op threads (None: ORT's default, all cores).
    provider:  ``auto`` | ``cpu`` | ``cuda`` | ``tensorrt`` (``ort_providers``); the
               pages live on the GPU for ``cuda`` and ``tensorrt``.
    providers: an explicit ORT ``providers`` list instead (advanced; its first entry
               decides where the pages live).
    device_id: the GPU for ``cuda`` / ``tensorrt``.
    selected_pages: fetch each layer's ``selected_pages`` output (tier policy, stats);
               None: always on the CPU EP, on a GPU only when the pool has a cold tier.
    inline:    inline model-local functions before the CUDA EP sees the model (ORT #27873).
    trust_package_engines: the TensorRT EP uses the package's ``trt_ep_cache`` (engines shipped
               with it: code) instead of this user's cache (``EngineConfig.trust_package_engines``).
    native_arch: ``-march`` of the native CPU decode kernel's build (``EngineConfig.native_arch``).
    plugin_dir: where ``tinyserve-build-plugin`` put the GPU libraries (``EngineConfig.plugin_dir``;
               None: its default cache).
    """

    name = "ort"
    reads_cold_pages = True

    def __init__(self, package, pool, threads: int | None = None, providers: list | None = None,
                 selected_pages: bool | None = None, provider: str = "auto", device_id: int = 0,
                 inline: bool = True, trust_package_engines: bool = False, native_arch: str | None = None,
                 plugin_dir: str | None = None):
        import onnxruntime as ort

        from tinyserve_trt.runtime.backends.ort_providers import check_provider, resolve_provider
        from tinyserve_trt.runtime.backends.transfer import TransferCounter

        if np.dtype(package.dtype) != pool.k_pages(0).dtype:
            raise ValueError(f"page pool dtype {pool.k_pages(0).dtype} does not match the model's {package.dtype}")
        if (pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.page_size) != (
                package.num_layers, package.num_kv_heads, package.head_dim, package.page_size):
            raise ValueError("page pool geometry (layers, kv heads, head dim, page size) does not match the package")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a positive int, got {threads!r}")
        check_provider(provider)
        self.package, self.pool, self._ort = package, pool, ort
        self._trust_package_engines = bool(trust_package_engines)
        self._native_arch, self._plugin_dir = native_arch, plugin_dir
        self.provider = _kind_of(providers) if providers else resolve_provider(ort, provider)
        self.session = self._open_session(ort, threads, providers, device_id, inline)
        on_gpu = self.provider != "cpu"
        if selected_pages is None:
            selected_pages = not on_gpu or bool(pool.storage.num_cold)
        want_selected = selected_pages and all("selected_pages" in n for n in package.layers)
        self.transfer = TransferCounter("cuda" if on_gpu else "cpu")
        self._device = None
        if on_gpu:
            from tinyserve_trt.runtime.backends.ort_binding import DeviceBinding

            self._device = DeviceBinding(package, pool, self.session, self.transfer, device_id, want_selected)
            return
        self._init_host(package, pool, want_selected)

    # ---- session (kept apart from the binding: loading may change on its own) ----
    def _open_session(self, ort, threads: int | None, providers: list | None, device_id: int, inline: bool):
        """The InferenceSession for ``self.provider``; a GPU EP that ORT refuses is one
        RuntimeError naming the fix (never a silent CPU fallback)."""
        from tinyserve_trt.runtime.backends.ort_providers import inlined_model, provider_list, session_error

        so = ort.SessionOptions()
        so.log_severity_level = 3
        if threads is not None:
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
        kind = self.provider
        providers = providers or provider_list(kind, self.package, device_id, self._trust_package_engines,
                                               self._plugin_dir)
        if kind == "cpu":
            # The exporter's ORT-optimized copy is CPU-EP specific; other providers start from the portable model.
            return self._cpu_session(ort, so, providers)
        model = self.package.model_path
        self._report = _gpu_report(kind, self.package, providers)
        if kind == "cuda" and inline:
            model = inlined_model(model)  # ORT #27873: the CUDA EP may fail on model-local functions
        try:
            return ort.InferenceSession(model if isinstance(model, bytes) else str(model), so, providers=providers)
        except Exception as e:
            raise session_error(kind, model, e, inlined=inline) from None

    def _cpu_session(self, ort, so, providers: list):
        """The CPU EP session over ``_cpu_graph``; when ORT cannot load the optimized graph, the
        portable model (said in the kernel report); when it cannot load that either, one PackageError
        naming the file."""
        from tinyserve_trt.runtime.backends.ort_providers import first_line, load_error

        path = self._cpu_graph(ort, so)
        try:
            return ort.InferenceSession(str(path), so, providers=providers)
        except MemoryError:
            raise
        except Exception as e:  # ORT's InvalidProtobuf, InvalidGraph, Fail, ...: what the package holds
            if path == self.package.model_path:
                raise load_error(path, e) from None
            self._report = self._portable(f"ONNX Runtime cannot load {path.name} ({first_line(e)}); "
                                          "loading the portable model")
        try:
            return ort.InferenceSession(str(self.package.model_path), so, providers=providers)
        except MemoryError:
            raise
        except Exception as e:
            raise load_error(self.package.model_path, e) from None

    def _cpu_graph(self, ort, so):
        """The graph the CPU EP loads: ``model.ort.onnx`` when this ORT wrote it, with the native
        decode kernel's library registered in ``so`` when the graph calls it; the portable model
        (the op's ONNX function throughout) when that library cannot be built here. Which one, and
        why, goes into ``self._report`` (``kernel_report.py``)."""
        from tinyserve_trt.runtime.backends.kernel_report import KernelReport, export_note

        spec, opt = self.package.spec, self.package.spec.ort_optimized
        path = self.package.ort_model_path(ort.__version__)
        if path == self.package.model_path:
            if opt is None:
                self._report = self._portable(export_note(spec), fallback=False)
            else:
                self._report = self._portable(f"{opt.file} was written by ONNX Runtime {opt.onnxruntime}, this is "
                                              f"{ort.__version__}: loading the portable model (re-export to get it)")
            return path
        graph = path.relative_to(self.package.path).as_posix()
        if not opt.native:
            self._report = KernelReport("ort", "cpu", graph, "onnx_function", reason=export_note(spec))
            return path
        from tinyserve_trt.cpu import native
        from tinyserve_trt.cpu.node import RUNS_VERSIONS, VERSION

        try:
            found, nodes = _native_import(path, opt.native)  # what the graph imports; the plan records it too
        except Exception:  # an unreadable graph: the session fails on it below and loads the portable model
            found, nodes = None, ()
        if (found is None or found in RUNS_VERSIONS) and opt.plan.native_version not in (None, *RUNS_VERSIONS):
            found = opt.plan.native_version
        if found is not None and found not in RUNS_VERSIONS:  # its node reads inputs at other positions
            self._report = self._portable(f"{graph} calls the native node version {found}, this runtime's is "
                                          f"{VERSION}: loading the portable model (re-export the package for the "
                                          "native kernel)")
            return self.package.model_path
        try:  # the kernel runs its parallel work on this session's intra-op pool
            lib = native.register(so, self._native_arch)
            self._report = KernelReport("ort", "cpu", graph, "native_cpu", library=str(lib),
                                        nodes=tuple(f"{opt.native}::{t}" for t in nodes))
            return path
        except native.NativeUnavailable as e:
            reason = str(e)
        self._report = self._portable(f"the native CPU decode kernel is unavailable ({reason}); "
                                      "loading the portable model")
        return self.package.model_path

    def _portable(self, reason: str, fallback: bool = True):
        """The report of the portable model on the CPU EP: the op's ONNX function, because ``reason``."""
        from tinyserve_trt.runtime.backends.kernel_report import KernelReport

        graph = self.package.model_path.relative_to(self.package.path).as_posix()
        return KernelReport("ort", "cpu", graph, "onnx_function", fallback=fallback, reason=reason)

    def kernel_report(self):
        return self._report

    # ---- CPU EP: pages in host memory, shared with ORT ---------------------------
    def _init_host(self, package, pool, want_selected: bool) -> None:
        self._types = {i.name: _NP_TYPES.get(i.type, np.int64) for i in self.session.get_inputs()}
        self._out_types = {o.name: _NP_TYPES.get(o.type, np.float32) for o in self.session.get_outputs()}
        self._inputs = package.inputs
        self._binding = self.session.io_binding()
        self._pool_values: dict[str, tuple] = {}  # input -> ((buffer address, shape), OrtValue kept alive)
        self._pool_key = None  # the storage's buffer addresses when the pools were last bound
        plain = "key_cache_int8" not in pool.cache_inputs(0)
        self._unused_cold = _unused_cold_tier(package) if package.cold_tier and plain else None
        self._bind_pools()
        self._fed: dict[str, tuple] = {}  # role -> (buffer, its OrtValue): bound once, refilled in place
        self._out_shape = None  # (batch, new tokens, page-table width) the outputs are bound for
        self._out: dict[str, np.ndarray] = {}
        self._selected = None  # every layer's selected_pages output, one buffer (_bind_outputs)
        self._want_selected = want_selected

    def _bind_pools(self) -> None:
        """Bind every layer's cache inputs over the pool's arrays (shared, not copied);
        only those whose buffer changed since the last call are rebound (none, without
        a look at each layer, while the storage reports the same buffers)."""
        key = (id(self.pool.storage), *_buffers(self.pool.storage))
        if key == self._pool_key and len(key) > 1:
            return
        for layer, names in enumerate(self.package.layers):
            arrays = {**self.pool.cache_inputs(layer), **(self._unused_cold[layer] if self._unused_cold else {})}
            for role, array in arrays.items():
                name = names.get(role)
                if name is None:
                    continue
                address = (array.__array_interface__["data"][0], array.shape)
                if self._pool_values.get(name, (None,))[0] == address:
                    continue
                if not array.flags.c_contiguous:
                    raise ValueError(f"pool storage for {role} of layer {layer} is not contiguous")
                value = self._ort.OrtValue.ortvalue_from_numpy(array)  # shares the numpy buffer on CPU
                self._binding.bind_ortvalue_input(name, value)
                self._pool_values[name] = (address, value)
        self._pool_key = key

    def _feed(self, role: str, array: np.ndarray) -> None:
        """Copy ``array`` into the buffer bound to ``role``; bind a new buffer only when the
        shape changed (a decode step's feeds keep theirs until the page table widens)."""
        name = self._inputs[role]
        bound = self._fed.get(role, (None,))[0]
        if bound is not None and bound.shape == array.shape:
            np.copyto(bound, array, casting="unsafe")
        else:
            bound = np.array(array, self._types[name], order="C")
            value = self._ort.OrtValue.ortvalue_from_numpy(bound)  # shares the buffer on CPU: ORT reads it in place
            self._binding.bind_ortvalue_input(name, value)
            self._fed[role] = (bound, value)
        self.transfer.fed(role, bound.nbytes)

    def _bind_outputs(self, b: int, s: int, width: int) -> dict[str, np.ndarray]:
        """Output buffers ORT writes into, rebound only when the step's shapes change."""
        if self._out_shape == (b, s, width):
            return self._out
        pkg = self.package
        shapes = {pkg.logits: (b, 1 if "logits_index" in self._inputs else s, pkg.vocab_size)}
        self._binding.clear_binding_outputs()
        self._out = {}
        for name, shape in shapes.items():
            out = self._out[name] = np.empty(shape, self._out_types.get(name, np.float32))
            self._binding.bind_output(name, "cpu", 0, out.dtype, shape, out.ctypes.data)
        # every layer's selected_pages in one [L, B, Hkv, W] buffer: run() copies it once
        self._selected = None
        if self._want_selected:
            one = (b, pkg.num_kv_heads, width)
            dtype = self._out_types.get(pkg.layers[0]["selected_pages"], bool)
            self._selected = np.empty((len(pkg.layers), *one), dtype)
            for layer, names in enumerate(pkg.layers):
                out = self._out[names["selected_pages"]] = self._selected[layer]
                self._binding.bind_output(names["selected_pages"], "cpu", 0, out.dtype, one, out.ctypes.data)
        # every layer's new K (and V) in one [L, B, Hkv, S, D] buffer, which write_step reads
        # without stacking (per-layer arrays when the layers' dtypes differ)
        self._new_kv = []
        for role in ("new_key", "new_value"):
            names = [n[role] for n in pkg.layers]
            dtypes = {self._out_types.get(n, np.float32) for n in names}
            one = (b, pkg.num_kv_heads, s, pkg.head_dim)
            arrays = np.empty((len(names), *one), dtypes.pop()) if len(dtypes) == 1 else \
                [np.empty(one, self._out_types.get(n, np.float32)) for n in names]
            for name, out in zip(names, arrays):
                self._out[name] = out
                self._binding.bind_output(name, "cpu", 0, out.dtype, one, out.ctypes.data)
            self._new_kv.append(arrays)
        self._out_shape = (b, s, width)
        return self._out

    def run(self, batch: ScheduledBatch) -> StepOutput:
        n_layers = self.package.num_layers
        if len(batch) == 0:
            want = self._device.want_selected if self._device else self._want_selected
            empty = [np.zeros((0, self.pool.num_kv_heads, 1), bool)] * n_layers if want else None
            return StepOutput(np.zeros((0, self.package.vocab_size), np.float32), empty)
        self.transfer.begin_step()
        if self._device is not None:
            return self._device.run(batch)
        self._feed("input_ids", batch.input_ids)
        if "position_ids" in self._inputs:
            self._feed("position_ids", batch.positions)
        self._bind_pools()
        self._feed("page_table", self.pool.physical_table(batch.page_table))
        self._feed("past_lens", batch.past_lens)
        self._feed("token_budget", batch.token_budget)
        last = batch.num_new_tokens.astype(np.int64) - 1
        if "logits_index" in self._inputs:
            self._feed("logits_index", last)
        out = self._bind_outputs(*batch.input_ids.shape, batch.page_table.shape[1])
        self.session.run_with_iobinding(self._binding)
        logits = out[self.package.logits]
        # copies: the buffers are refilled by the next step
        logits = np.array(logits[:, 0] if "logits_index" in self._inputs else logits[np.arange(len(batch)), last],
                          np.float32)
        self.pool.write_step(batch.slot_mapping, *self._new_kv)
        selected = list(self._selected.copy()) if self._selected is not None else None  # views of one copy
        return StepOutput(logits, selected)

    def close(self) -> None:
        if self._device is not None:
            self._device.close()
        self._binding = None
        self._pool_values = {}
        self.session = None


def _native_import(path, domain: str) -> tuple[int | None, tuple[str, ...]]:
    """The opset version of ``domain`` the graph at ``path`` imports, and the node types of that domain
    its main graph runs, sorted (its nodes only are read)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    types = tuple(sorted({n.op_type for n in model.graph.node if n.domain == domain}))
    return next((op.version for op in model.opset_import if op.domain == domain), None), types


def _buffers(storage) -> tuple:
    """(data address, shape) of each array of a host storage (its ``buffers()``), () if it
    has none to show: then the pools are checked layer by layer every step."""
    buffers = getattr(storage, "buffers", None)
    return tuple((a.__array_interface__["data"][0], a.shape) for a in buffers()) if buffers else ()


def _kind_of(providers: list) -> str:
    """Where the pages live for an explicit providers list: its first entry's EP."""
    from tinyserve_trt.runtime.backends.ort_providers import EP_NAMES

    first = providers[0][0] if isinstance(providers[0], (tuple, list)) else providers[0]
    kinds = {v: k for k, v in EP_NAMES.items()}
    if first not in kinds:
        raise ValueError(f"unsupported first ORT provider {first!r}; use one of {sorted(kinds)}")
    return kinds[first]


def _gpu_report(kind: str, package, providers: list):
    """The kernel report of a GPU session: the TensorRT EP imports the op node as our plugin (its
    library in the EP's options); the CUDA EP runs the op's ONNX function, inlined."""
    from tinyserve_trt.runtime.backends.kernel_report import KernelReport

    graph = package.model_path.relative_to(package.path).as_posix()
    if kind == "tensorrt":
        options = next((p[1] for p in providers if isinstance(p, (tuple, list)) and p[0] == "TensorrtExecutionProvider"),
                       {})
        return KernelReport("ort", kind, graph, "tensorrt_plugin", library=options.get("trt_extra_plugin_lib_paths"))
    return KernelReport("ort", kind, graph, "cuda_ep", reason="the CUDA EP runs the op's ONNX function (its CUDA "
                        "kernels run as the TensorRT plugin: --ort-provider tensorrt)")


def _unused_cold_tier(package) -> list[dict[str, np.ndarray]]:
    """Per layer, one zero cold page per cold input in that layer's format (int8_layers), for a
    cold-tier package over a plain pool (page ids stay below the hot pool's size, so the op never reads it)."""
    from tinyserve_trt.contracts.cold_tier import unused_cold_inputs

    return [unused_cold_inputs(package.cold_tier, package.num_kv_heads, package.page_size, package.head_dim, i)
            for i in range(package.num_layers)]
