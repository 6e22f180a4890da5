"""A stand-in TensorRT engine and ``torch.cuda`` for TrtBackend tests on CPU.

The fake engine computes a toy model from the bytes at the addresses bound to its
context: K/V from (token, position, layer), logits from the row's cached keys read
through the page table (cold pages, physical ids >= P, dequantized from the bound
INT8 pools, as the op). A two-level fake (``sub_page_size``) also takes
``key_sub_bounds.{i}`` on its sparse layers (not layer 0, dense) and checks, each step,
that the codes bound there for the pages a row reads are ``ops.fine_bounds``' of the
bound keys and min/max (``FakeEngine.sub_checks``). A fake "graph" records the ``execute_async_v3`` calls made
during capture and re-runs them on replay. ``fake_backend`` builds a TrtBackend on
them over a plain or a tiered pool; ``greedy`` drives it with a real Scheduler.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import types

import numpy as np
import pytest
import torch

from tinyserve_trt.runtime.backends import trt as trt_backend
from tinyserve_trt.ops import schema
from tinyserve_trt.ops.cold_codec import ColdCodec
from tinyserve_trt.runtime.backends.device_pages import COLD_ROLES, HOT_ROLES
from tinyserve_trt.runtime.config import CacheConfig, SchedulerConfig
from tinyserve_trt.runtime.pages import PagePool
from tinyserve_trt.runtime.sampling import SamplingParams
from tinyserve_trt.runtime.scheduler import Scheduler
from tinyserve_trt.contracts.cold_tier import tier_codec
from tinyserve_trt.runtime.tiers import TierConfig, TieredPagePool

LAYERS, HEADS, DIM, PAGE_SIZE, VOCAB, PAGES = 2, 2, 4, 4, 16, 48  # DIM even: INT4 packs channel pairs
NP = {"INT32": np.int32, "INT64": np.int64, "FLOAT": np.float32, "INT8": np.int8, "UINT8": np.uint8,
      "HALF": np.float16}
TRT_TYPES = {"int8": "INT8", "uint8": "UINT8", "float32": "FLOAT", "float16": "HALF"}
COLD_TIER = dict(k_granularity="channel", v_granularity="token")

# ---- a stand-in TensorRT ------------------------------------------------------------
_capturing: list = []  # the fake CUDAGraph being captured, if any


def _spec(cold=False, two_level: bool = False) -> dict[str, tuple[str, str]]:
    """``cold``: False, the package's cold format (True = int8) or a list with each layer's (an
    int4 package's int8_layers): the cold inputs' types are ``schema.COLD_DTYPES`` of it, as the
    engine built from the exported model has them."""
    formats = cold if isinstance(cold, list) else [cold] * LAYERS
    formats = ["int8" if f is True else f or "int8" for f in formats]
    spec = {n: ("INPUT", "INT32") for n in ("input_ids", "position_ids", "page_table", "past_lens", "token_budget")}
    spec["logits_index"] = ("INPUT", "INT64")
    for i in range(LAYERS):
        spec.update({f"{r}.{i}": ("INPUT", "FLOAT") for r in HOT_ROLES})
        if cold:
            cold_types = dict(zip(COLD_ROLES, schema.COLD_DTYPES[formats[i]]))
            spec.update({f"{r}.{i}": ("INPUT", TRT_TYPES[cold_types[r]]) for r in COLD_ROLES})
        if two_level and i > 0:  # layer 0 is dense: single level, no fine bounds
            spec[f"key_sub_bounds.{i}"] = ("INPUT", "UINT8")
        spec.update({f"new_key.{i}": ("OUTPUT", "FLOAT"), f"new_value.{i}": ("OUTPUT", "FLOAT"),
                     f"selected_pages.{i}": ("OUTPUT", "INT32")})
    spec["logits"] = ("OUTPUT", "FLOAT")
    return spec


class FakeEngine:
    device_memory_size_v2 = 4096

    def __init__(self, capturable: bool = True, cold=False, two_level: bool = False):
        self.spec, self.capturable, self.contexts = _spec(cold, two_level), capturable, []
        self.names = list(self.spec)
        self.last_context = None  # per row: the sum the toy model read from the cache
        self.sub_checks = [0, 0]  # (pages whose bound codes were checked, of them stale)

    num_io_tensors = property(lambda self: len(self.names))

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_mode(self, name):
        return types.SimpleNamespace(name=self.spec[name][0])

    def get_tensor_dtype(self, name):
        return types.SimpleNamespace(name=self.spec[name][1])

    def create_execution_context(self, strategy=None):
        self.contexts.append(FakeContext(self, strategy))
        return self.contexts[-1]


class FakeContext:
    def __init__(self, engine, strategy):
        self.engine, self.strategy = engine, strategy
        self.shapes, self.addrs, self.log, self.memory = {}, {}, [], None

    def set_device_memory(self, ptr, size):
        self.memory = (ptr, size)

    def set_input_shape(self, name, shape):
        self.log.append("bind")
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, ptr):
        self.log.append("bind")
        self.addrs[name] = ptr
        return True

    def get_tensor_shape(self, name):
        (b, t), w = self.shapes["input_ids"], self.shapes["page_table"][1]
        if name == "logits":
            return (b, 1, VOCAB)
        return (b, HEADS, w) if name.startswith("selected_pages") else (b, HEADS, t, DIM)

    def _view(self, name, shape=None):
        shape = shape or self.shapes.get(name) or self.get_tensor_shape(name)
        dtype = np.dtype(NP[self.engine.spec[name][1]])
        size = int(np.prod(shape)) * dtype.itemsize
        return np.frombuffer((ctypes.c_char * size).from_address(self.addrs[name]), dtype).reshape(shape)

    def execute_async_v3(self, stream_handle):
        if _capturing:
            self.log.append("capture")
            if not self.engine.capturable:
                return False
            _capturing[-1].ops.append(self._compute)
            return True
        self.log.append("execute")
        self._compute()
        return True

    def _compute(self):
        """A toy model: K/V from (token, position, layer); logits from the row's cached keys."""
        ids, pos = self._view("input_ids"), self._view("position_ids")
        table, past, last = self._view("page_table"), self._view("past_lens"), self._view("logits_index")
        b_rows, width = ids.shape
        context = np.zeros(b_rows)
        for layer in range(LAYERS):
            grid = 0.5 * np.arange(HEADS)[:, None, None] + 0.125 * np.arange(DIM)
            key = (ids + 0.25 * pos + layer)[:, None, :, None] + grid
            self._view(f"new_key.{layer}")[...] = key
            self._view(f"new_value.{layer}")[...] = -key
            pages = -(-past // PAGE_SIZE)
            self._view(f"selected_pages.{layer}")[...] = np.arange(table.shape[1]) < pages[:, None, None]
            cache = self._view(f"key_cache.{layer}")
            if f"key_cache_int8.{layer}" in self.shapes:  # physical ids >= P are cold: dequantized, as the op
                pool = self._view(f"key_cache_int8.{layer}")
                codec = ColdCodec("int4" if pool.dtype == np.uint8 else "int8")  # the format is the pool's dtype
                P = cache.shape[0]  # INT4 keys read their page's bounds (by physical id)
                sub = f"key_sub_bounds.{layer}"  # two-level: INT4 keys on the sub-page codes
                codes = self._view(sub)[P:] if sub in self.engine.spec else None
                cold = codec.dequantize_keys(pool, self._view(f"key_scale.{layer}"),
                                             self._view(f"key_min.{layer}")[P:], self._view(f"key_max.{layer}")[P:],
                                             sub_codes=codes)
                cache = np.concatenate([cache, cold])
            for b in range(b_rows):  # never reads a page-table column past past_lens
                slots = np.arange(past[b])
                context[b] += cache[table[b, slots // PAGE_SIZE], 0, slots % PAGE_SIZE, 0].sum()
            if f"key_sub_bounds.{layer}" in self.engine.spec:
                self._check_sub_bounds(layer, table, past)
        self.engine.last_context = context
        rows = np.arange(b_rows)
        phase = ids[rows, last] + 0.1 * pos[rows, last] + 1e-3 * context
        self._view("logits")[...] = np.cos(0.37 * np.arange(VOCAB) * (1 + phase[:, None]))[:, None, :]


    def _check_sub_bounds(self, layer, table, past):
        """Count the pages (hot, read by a row before this step's append) whose bound codes
        differ from ``ops.fine_bounds``' codes of the bound keys and min/max."""
        from tinyserve_trt.ops.fine_bounds import page_sub_bounds

        codes, cache = self._view(f"key_sub_bounds.{layer}"), self._view(f"key_cache.{layer}")
        kmin, kmax = self._view(f"key_min.{layer}"), self._view(f"key_max.{layer}")
        sub = PAGE_SIZE // codes.shape[2]
        for b in range(len(past)):
            for j in range(-(-int(past[b]) // PAGE_SIZE)):
                p = table[b, j]
                if p >= cache.shape[0]:
                    continue
                want = page_sub_bounds(cache[p], sub, kmin[p], kmax[p], min(PAGE_SIZE, past[b] - j * PAGE_SIZE))
                self.engine.sub_checks[0] += 1
                self.engine.sub_checks[1] += int(not np.array_equal(codes[p], want))


class FakeCudaGraph:
    def __init__(self):
        self.ops = []

    def replay(self):
        for op in self.ops:
            op()


@contextlib.contextmanager
def _fake_capture(graph, stream=None):
    if stream is None or stream.cuda_stream == 0:
        raise RuntimeError("capture needs a non-default stream")
    _capturing.append(graph)
    try:
        yield
    finally:
        _capturing.pop()


class FakeLogger:
    WARNING = 1

    def __init__(self, level):
        pass


class FakeStream:
    cuda_stream = 7

    def __init__(self, device=None):
        pass

    def synchronize(self):
        pass


def _fake_torch() -> types.ModuleType:
    """Real torch, except that devices are the CPU and ``torch.cuda`` streams/graphs are fakes."""
    fake = types.ModuleType("torch")
    fake.__getattr__ = lambda name: getattr(torch, name)
    fake.device = lambda *args, **kwargs: torch.device("cpu")
    fake.cuda = types.SimpleNamespace(Stream=FakeStream, stream=lambda s: contextlib.nullcontext(),
                                      CUDAGraph=FakeCudaGraph, graph=_fake_capture)
    return fake


_appended: list[int] = []  # rows of each append call


def _fake_append(lib, shapes, pointers, dtype, stream=0):
    """``library.append_kv`` on host memory: views the buffers behind the addresses the backend
    passes (the fake devices are the CPU) and applies ``append_kv_ref`` in place."""
    from tinyserve_dev.kernels.references import append_kv_ref

    assert lib == "fake-lib" and stream == FakeStream.cuda_stream  # stream-ordered on the backend's stream
    names = ("key", "value", "key_cache", "value_cache", "key_min", "key_max", "page_table", "past_lens")
    types_ = dict(page_table=np.int32, past_lens=np.int32)
    views = {}
    for n in (*names, "error_flags"):
        shape = tuple(shapes[n])
        dt = np.dtype(types_.get(n, np.int32 if n == "error_flags" else dtype))
        buf = (ctypes.c_char * (int(np.prod(shape)) * dt.itemsize)).from_address(pointers[n])
        views[n] = np.frombuffer(buf, dtype=dt).reshape(shape)
    _appended.append(shapes["key"][0])
    P, ps = shapes["key_cache"][0], shapes["key_cache"][2]
    for b, past in enumerate(views["past_lens"]):  # what the kernel flags instead of writing
        touched = views["page_table"][b, past // ps: -(-(int(past) + shapes["key"][2]) // ps)]
        if ((touched < 0) | (touched >= P)).any():
            views["error_flags"][0] |= 1  # QSA_FLAG_BAD_PAGE_ID
            return
    got = append_kv_ref(*(views[n].copy() for n in names))
    for n, src in zip(("key_cache", "value_cache", "key_min", "key_max"), got):
        views[n][...] = src


@pytest.fixture
def fake_backend(monkeypatch, tmp_path):
    """backend(cuda_graphs=..., capturable=..., tiered=..., sub_page_size=..., **limits) -> (TrtBackend on
    fakes, its pool). ``sub_page_size``: a two-level package (layer 1 sparse, ``key_sub_bounds.1``)."""
    (tmp_path / "model.plan").write_bytes(b"fake")
    layers = [{r: f"{r}.{i}" for r in (*HOT_ROLES, *COLD_ROLES, "new_key", "new_value", "selected_pages")}
              for i in range(LAYERS)]
    package = types.SimpleNamespace(
        path=tmp_path, dtype="float32", layers=layers, logits="logits", cold_tier=None,
        manifest={"engine": {"file": "model.plan", "max_batch": 8, "max_pages": 16}},
        inputs={r: r for r in ("input_ids", "position_ids", "page_table", "past_lens", "token_budget",
                               "logits_index")})
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())
    monkeypatch.setattr("tinyserve_trt.cuda.library.append_kv", _fake_append)
    monkeypatch.setattr("tinyserve_trt.cuda.library.load", lambda path=None: "fake-lib")
    _appended.clear()

    def make(cuda_graphs=True, capturable=True, tiered=False, sub_page_size=0, cold_tier=COLD_TIER, **limits):
        """``limits``: extra ``manifest["engine"]`` entries (max_pool_pages, max_cold_pages);
        ``cold_tier``: the package's (with ``tiered``), e.g. an INT4 one."""
        formats = [tier_codec(cold_tier, i).cold_format for i in range(LAYERS)]  # per layer (int8_layers)
        engine = FakeEngine(capturable, cold=tiered and formats, two_level=bool(sub_page_size))
        for i, names in enumerate(layers):
            names.pop("key_sub_bounds", None)
            if sub_page_size and i > 0:
                names["key_sub_bounds"] = f"key_sub_bounds.{i}"
        package.cold_tier = cold_tier if tiered else None
        package.manifest = {"engine": {"file": "model.plan", "max_batch": 8, "max_pages": 16, **limits}}
        trt = types.SimpleNamespace(
            Logger=FakeLogger, Runtime=lambda logger: types.SimpleNamespace(deserialize_cuda_engine=lambda b: engine),
            ExecutionContextAllocationStrategy=types.SimpleNamespace(USER_MANAGED="user"))
        monkeypatch.setattr(trt_backend, "_load_tensorrt", lambda plugin_dir=None: trt)
        cache = CacheConfig(page_size=PAGE_SIZE, num_pages=PAGES, dtype="float32", sub_page_size=sub_page_size)
        pool = TieredPagePool(cache, TierConfig(num_cold_pages=PAGES, **cold_tier), LAYERS, HEADS, DIM) if tiered \
            else PagePool(cache, LAYERS, HEADS, DIM)
        with monkeypatch.context() as m:
            m.setitem(sys.modules, "torch", _fake_torch())
            backend = trt_backend.TrtBackend(package, pool, cuda_graphs=cuda_graphs)
        return backend, pool

    return make


def greedy(backend, pool, requests):
    """Drive ``backend`` with a real Scheduler; per step (kind, batch size, width, logits)."""
    sched = Scheduler(SchedulerConfig(max_batch=8, max_tokens_per_step=64, prefill_chunk=8), pool)
    for rid, (prompt, n) in requests.items():
        sched.add(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    steps = []
    while sched.has_unfinished():
        batch = sched.schedule()
        out = backend.run(batch)
        # copies: on the CPU stand-in ``.cpu()`` aliases the graph's static outputs (on a GPU it copies)
        steps.append(("decode" if batch.input_ids.shape[1] == 1 else "prefill", len(batch),
                      batch.page_table.shape[1], out.logits.copy(), [s.copy() for s in out.selected_pages]))
        sched.postprocess(batch, out.logits.argmax(axis=1))
    return steps


REQUESTS = {"a": (list(range(1, 6)), 9), "b": ([(7 * i) % 15 + 1 for i in range(11)], 12), "c": ([3, 1, 4], 5)}


def require_trt_gpu() -> None:
    """Skip (with the reason) unless TensorRT, the plugin library, cuda-python, a CUDA
    device and transformers are all present - what a real engine test needs."""
    try:
        import tensorrt  # noqa: F401
    except Exception:
        pytest.skip("TensorRT is not installed: this test needs a TensorRT engine")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    try:
        trt_backend._load_tensorrt()
    except RuntimeError as e:  # plugin library or cuda-python missing
        pytest.skip(str(e))
    pytest.importorskip("transformers")
