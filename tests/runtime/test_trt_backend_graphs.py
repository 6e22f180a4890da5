"""TrtBackend's decode-step CUDA graphs.

On CPU (every run): the backend's graph glue against a stand-in TensorRT engine and
a stand-in ``torch.cuda``. The fake engine computes a toy model from the bytes at the
addresses bound to its context, and a fake "graph" records the ``execute_async_v3``
calls made during capture and re-runs them on replay, so a static input that is not
refreshed, an address bound after capture or a padding row that reaches the pool shows
up as a wrong logit or page. This checks bucketing, binding and fallback, not TensorRT
or CUDA semantics.

On a GPU with TensorRT and the plugin (marked ``gpu``/``trt``, skipped otherwise):
greedy tokens with graphs on and off agree on a tiny LLaMA engine.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import types
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tinyserve_trt.runtime.backends import trt as trt_backend  # noqa: E402
from tinyserve_trt.ops.quantization import dequantize_page, quantize_page  # noqa: E402
from tinyserve_trt.runtime.backends.device_pages import COLD_ROLES, HOT_ROLES  # noqa: E402
from tinyserve_trt.runtime.config import CacheConfig, SchedulerConfig  # noqa: E402
from tinyserve_trt.runtime.pages import PagePool  # noqa: E402
from tinyserve_trt.runtime.sampling import SamplingParams  # noqa: E402
from tinyserve_trt.runtime.scheduler import Scheduler  # noqa: E402
from tinyserve_trt.runtime.tiers import TierConfig, TieredPagePool  # noqa: E402

LAYERS, HEADS, DIM, PAGE_SIZE, VOCAB, PAGES = 2, 2, 3, 4, 16, 48
NP = {"INT32": np.int32, "INT64": np.int64, "FLOAT": np.float32, "INT8": np.int8}
COLD_TIER = dict(k_granularity="channel", v_granularity="token")

# ---- a stand-in TensorRT ------------------------------------------------------------
_capturing: list = []  # the fake CUDAGraph being captured, if any


def _spec(cold: bool = False) -> dict[str, tuple[str, str]]:
    spec = {n: ("INPUT", "INT32") for n in ("input_ids", "position_ids", "page_table", "past_lens", "token_budget")}
    spec["logits_index"] = ("INPUT", "INT64")
    for i in range(LAYERS):
        spec.update({f"{r}.{i}": ("INPUT", "FLOAT") for r in HOT_ROLES})
        if cold:
            spec.update({f"{r}.{i}": ("INPUT", "INT8" if r.endswith("int8") else "FLOAT") for r in COLD_ROLES})
        spec.update({f"new_key.{i}": ("OUTPUT", "FLOAT"), f"new_value.{i}": ("OUTPUT", "FLOAT"),
                     f"selected_pages.{i}": ("OUTPUT", "INT32")})
    spec["logits"] = ("OUTPUT", "FLOAT")
    return spec


class FakeEngine:
    device_memory_size_v2 = 4096

    def __init__(self, capturable: bool = True, cold: bool = False):
        self.spec, self.capturable, self.contexts = _spec(cold), capturable, []
        self.names = list(self.spec)
        self.last_context = None  # per row: the sum the toy model read from the cache

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
                cold = self._view(f"key_cache_int8.{layer}").astype(np.float32) * self._view(f"key_scale.{layer}")
                cache = np.concatenate([cache, cold])
            for b in range(b_rows):  # never reads a page-table column past past_lens
                slots = np.arange(past[b])
                context[b] += cache[table[b, slots // PAGE_SIZE], 0, slots % PAGE_SIZE, 0].sum()
        self.engine.last_context = context
        rows = np.arange(b_rows)
        phase = ids[rows, last] + 0.1 * pos[rows, last] + 1e-3 * context
        self._view("logits")[...] = np.cos(0.37 * np.arange(VOCAB) * (1 + phase[:, None]))[:, None, :]


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


def _fake_append(key, value, key_cache, value_cache, key_min, key_max, page_table, past_lens):
    from tinyserve_trt.kernels.references import append_kv_ref

    _appended.append(key.shape[0])
    got = append_kv_ref(*(t.numpy() for t in (key, value, key_cache, value_cache, key_min, key_max,
                                              page_table, past_lens)))
    for dst, src in zip((key_cache, value_cache, key_min, key_max), got):
        dst.copy_(torch.from_numpy(src))


@pytest.fixture
def fake_backend(monkeypatch, tmp_path):
    """backend(cuda_graphs=..., capturable=...) -> (TrtBackend on fakes, its PagePool)."""
    (tmp_path / "model.plan").write_bytes(b"fake")
    layers = [{r: f"{r}.{i}" for r in (*HOT_ROLES, *COLD_ROLES, "new_key", "new_value", "selected_pages")}
              for i in range(LAYERS)]
    package = types.SimpleNamespace(
        path=tmp_path, dtype="float32", layers=layers, logits="logits", cold_tier=None,
        manifest={"engine": {"file": "model.plan", "max_batch": 8, "max_pages": 16}},
        inputs={r: r for r in ("input_ids", "position_ids", "page_table", "past_lens", "token_budget",
                               "logits_index")})
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())
    monkeypatch.setattr("tinyserve_trt.kernels.harness.append_kv_gpu", _fake_append)
    _appended.clear()

    def make(cuda_graphs=True, capturable=True, tiered=False):
        engine = FakeEngine(capturable, cold=tiered)
        package.cold_tier = COLD_TIER if tiered else None
        trt = types.SimpleNamespace(
            Logger=FakeLogger, Runtime=lambda logger: types.SimpleNamespace(deserialize_cuda_engine=lambda b: engine),
            ExecutionContextAllocationStrategy=types.SimpleNamespace(USER_MANAGED="user"))
        monkeypatch.setattr(trt_backend, "_load_tensorrt", lambda: trt)
        cache = CacheConfig(page_size=PAGE_SIZE, num_pages=PAGES, dtype="float32")
        pool = TieredPagePool(cache, TierConfig(num_cold_pages=PAGES, **COLD_TIER), LAYERS, HEADS, DIM) if tiered \
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


def test_fake_engine_graphs_match_plain_execution(fake_backend):
    plain, plain_pool = fake_backend(cuda_graphs=False)
    graphs, graph_pool = fake_backend(cuda_graphs=True)
    want, got = greedy(plain, plain_pool, REQUESTS), greedy(graphs, graph_pool, REQUESTS)
    assert [s[:3] for s in got] == [s[:3] for s in want]
    kinds = {(s[1], s[2]) for s in got if s[0] == "decode"}
    assert any(b not in graphs.buckets.batch_sizes for b, _ in kinds)  # padding rows ran
    assert any(w not in graphs.buckets.widths for _, w in kinds)  # padding columns ran
    for (_, b, w, logits, selected), (*_, want_logits, want_selected) in zip(got, want):
        np.testing.assert_array_equal(logits, want_logits)
        assert logits.shape == (b, VOCAB)
        for s, ws in zip(selected, want_selected):
            assert s.shape == (b, HEADS, w)
            np.testing.assert_array_equal(s, ws)
    for mine, theirs in zip(graphs.pages.layers, plain.pages.layers):  # padding rows wrote nothing
        for role in HOT_ROLES:
            np.testing.assert_array_equal(mine[role].numpy(), theirs[role].numpy())
    assert graphs.cuda_graphs and set(graphs._graphs) == {graphs.buckets.shape(b, w) for b, w in kinds}


def test_each_bucket_is_captured_once_after_a_warm_up_and_never_rebound(fake_backend):
    backend, pool = fake_backend()
    steps = greedy(backend, pool, REQUESTS)
    engine = backend.engine
    plain, graph_contexts = engine.contexts[0], engine.contexts[1:]
    assert len(graph_contexts) == len(backend._graphs) >= 2
    assert plain.log.count("execute") == sum(s[0] == "prefill" for s in steps) and "capture" not in plain.log
    for ctx in graph_contexts:
        assert ctx.strategy == "user" and ctx.memory == graph_contexts[0].memory  # one shared activation buffer
        assert ctx.log[-2:] == ["execute", "capture"] and set(ctx.log[:-2]) == {"bind"}
    assert sum(_appended) == sum(s[1] for s in steps) * LAYERS  # real rows only


def test_capture_failure_warns_once_and_runs_plainly(fake_backend):
    want = greedy(*fake_backend(cuda_graphs=False), REQUESTS)
    backend, pool = fake_backend(capturable=False)
    with pytest.warns(RuntimeWarning, match="CUDA graph capture failed") as record:
        got = greedy(backend, pool, REQUESTS)
    assert len([w for w in record if "CUDA graph" in str(w.message)]) == 1
    assert not backend.cuda_graphs and len(backend.engine.contexts) == 2  # no second attempt
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g[3], w[3])


@pytest.mark.parametrize("how", ["option", "env"])
def test_graphs_can_be_turned_off(fake_backend, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv(trt_backend.GRAPHS_ENV, "0")
    backend, pool = fake_backend(cuda_graphs=how != "option")
    assert not backend.cuda_graphs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        greedy(backend, pool, REQUESTS)
    assert len(backend.engine.contexts) == 1


def test_batch_outside_the_profile_raises_before_running(fake_backend):
    backend, pool = fake_backend()
    sched = Scheduler(SchedulerConfig(max_batch=8), pool)
    sched.add("long", list(range(1, 70)), SamplingParams(max_tokens=1))  # 18 pages > max_pages 16
    with pytest.raises(RuntimeError, match=r"batch 1 x 18 pages is outside the engine's profile \(8 x 16\)"):
        backend.run(sched.schedule())


def _toy_page_keys(tokens: list[int], page: int, layer: int) -> np.ndarray:
    """``[HEADS, PAGE_SIZE, DIM]`` keys the fake engine computed for a full logical page."""
    pos = np.arange(page * PAGE_SIZE, (page + 1) * PAGE_SIZE)
    ids = np.asarray(tokens, np.float32)[pos]
    grid = 0.5 * np.arange(HEADS)[:, None, None] + 0.125 * np.arange(DIM)
    return ((ids + 0.25 * pos + layer)[None, :, None] + grid).astype(np.float32)


def test_cold_pages_are_bound_addressed_physically_and_quantized_on_the_device(fake_backend):
    """A tiered pool: every full page but a sequence's last is demoted after each step.
    The toy model reads each row's cached keys through the page table; what it read
    must be the exact keys for hot pages and their INT8 round trip for cold ones."""
    backend, pool = fake_backend(tiered=True)
    assert backend.reads_cold_pages and backend.pages.num_cold == PAGES
    sched = Scheduler(SchedulerConfig(max_batch=8, max_tokens_per_step=64, prefill_chunk=8), pool)
    for rid, (prompt, n) in REQUESTS.items():
        sched.add(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    read_cold = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        cold_pages = [[p for p in s.pages if not pool.is_hot(p)] for s in batch.seqs]
        out = backend.run(batch)
        for row, seq in enumerate(batch.seqs):
            past = int(batch.past_lens[row])
            want = 0.0
            for layer in range(LAYERS):
                for lp in range(-(-past // PAGE_SIZE)):
                    n = min(PAGE_SIZE, past - lp * PAGE_SIZE)
                    if seq.pages[lp] in cold_pages[row]:
                        keys = _toy_page_keys(seq.token_ids, lp, layer)
                        keys = dequantize_page(*quantize_page(keys, COLD_TIER["k_granularity"]))
                        read_cold += 1
                    else:
                        keys = _toy_page_keys(seq.token_ids + [0] * PAGE_SIZE, lp, layer)
                    want += float(keys[0, :n, 0].sum())
            np.testing.assert_allclose(backend.engine.last_context[row], want, rtol=1e-6)
        sched.postprocess(batch, out.logits.argmax(axis=1))
        for seq in sched.running:  # demote between steps, as Tiering.rebalance does
            for page in seq.pages[:-1]:
                if pool.is_hot(page) and pool.is_full(page):
                    pool.demote(page)
    assert read_cold > 0 and pool.num_cold_free < PAGES
    pool.check_integrity()


# ---- on a GPU with TensorRT -------------------------------------------------------------
@pytest.fixture(scope="module")
def trt_llama(tiny_root):
    try:
        import tensorrt  # noqa: F401
    except Exception:
        pytest.skip("TensorRT is not installed: decode-step CUDA graphs need a TensorRT engine")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    try:
        trt_backend._load_tensorrt()
    except RuntimeError as e:  # plugin library or cuda-python missing
        pytest.skip(str(e))
    pytest.importorskip("transformers")
    from tests.tiny_models import build_package

    root = tiny_root / "trt-graphs"
    root.mkdir(exist_ok=True)
    return build_package("llama", root, backend="trt", max_context=256)[1]


@pytest.mark.gpu
@pytest.mark.trt
def test_gpu_graphs_and_plain_agree(trt_llama):
    from tinyserve_trt import LLM

    prompts = [list(range(7, 12)), [(i * 37 + 11) % 256 for i in range(23)], [(i * 91 + 5) % 256 for i in range(41)]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        llm = LLM(trt_llama, backend="trt", backend_options={"cuda_graphs": graphs})
        outs[graphs] = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, params=params)]
        backend = llm.engine.backend
        assert backend.cuda_graphs == graphs and (not graphs or backend._graphs)
        backend.close()
    assert outs[True] == outs[False]
