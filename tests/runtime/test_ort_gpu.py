"""OrtBackend on a GPU execution provider, against a stand-in onnxruntime and torch.cuda on CPU.

What is checked without a GPU: on the CUDA / TensorRT EP the pools are DevicePages bound
by device pointer ('cuda'), never bound from host memory and never copied to or from the
host in a step; the step's K/V are written into the pools on the "device" (the same page
contents and logits as the CPU EP path); the transfer counter is O(new tokens + page
table), independent of the context and of the pool size; the provider choice hands ORT
the right model and options and fails in one line instead of falling back.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.runtime.ort_fakes import (COLD_TIER, DIM, HEADS, LAYERS, PAGE_SIZE, VOCAB, fake_ort,  # noqa: E402
                                     fake_package, fake_torch)
from tinyserve_trt.runtime.backends.ort import OrtBackend  # noqa: E402
from tinyserve_trt.runtime.config import CacheConfig, SchedulerConfig  # noqa: E402
from tinyserve_trt.runtime.pages import PagePool  # noqa: E402
from tinyserve_trt.runtime.sampling import SamplingParams  # noqa: E402
from tinyserve_trt.runtime.scheduler import Scheduler  # noqa: E402
from tinyserve_trt.runtime.tiers import TierConfig, TieredPagePool  # noqa: E402

GPU = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


@pytest.fixture
def make(monkeypatch, tmp_path):
    """make(provider, pages=48, tiered=False, **options) -> (OrtBackend on fakes, pool, fake ort)."""
    monkeypatch.setattr("tinyserve_trt.runtime.backends.ort_binding.kernel_writer_available", lambda: False)

    def build(provider="cuda", pages=48, tiered=False, ort=None, cold_tier=COLD_TIER, **options):
        ort = ort or fake_ort(GPU, "GPU")
        ort.cold = tiered and cold_tier.get("cold_format", "int8")
        package = fake_package(tmp_path, cold_tier if tiered else None)
        cache = CacheConfig(page_size=PAGE_SIZE, num_pages=pages, dtype="float32")
        pool = TieredPagePool(cache, TierConfig(num_cold_pages=pages, **cold_tier), LAYERS, HEADS, DIM) if tiered \
            else PagePool(cache, LAYERS, HEADS, DIM)
        with monkeypatch.context() as m:
            m.setitem(sys.modules, "onnxruntime", ort)
            m.setitem(sys.modules, "torch", fake_torch())
            options.setdefault("inline", False)
            backend = OrtBackend(package, pool, provider=provider, **options)
        return backend, pool, ort

    return build


def drive(backend, pool, requests, demote=False):
    """Greedy decode with a real Scheduler; per step (kind, logits, h2d log, d2h log)."""
    sched = Scheduler(SchedulerConfig(max_batch=8, max_tokens_per_step=64, prefill_chunk=8), pool)
    for rid, (prompt, n) in requests.items():
        sched.add(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    steps = []
    while sched.has_unfinished():
        batch = sched.schedule()
        out = backend.run(batch)
        kind = "decode" if batch.input_ids.shape[1] == 1 else "prefill"
        steps.append((kind, out.logits.copy(), dict(backend.transfer.last_h2d), dict(backend.transfer.last_d2h),
                      batch.page_table.shape))
        sched.postprocess(batch, out.logits.argmax(axis=1))
        if demote:  # every full page but a sequence's last goes cold, as Tiering.rebalance may
            for seq in sched.running:
                for page in seq.pages[:-1]:
                    if pool.is_hot(page) and pool.is_full(page):
                        pool.demote(page)
    return steps


REQUESTS = {"a": (list(range(1, 6)), 9), "b": ([(7 * i) % 15 + 1 for i in range(11)], 12), "c": ([3, 1, 4], 5)}


def test_pools_are_device_buffers_bound_by_pointer_once(make):
    backend, pool, ort = make("cuda")
    binding = ort.sessions[0].binding
    pages = backend._device.pages
    assert pool.storage is pages  # attached: the pool's data lives in the device tensors
    pool_names = {n for names in backend.package.layers for r, n in names.items() if r in pages.roles}
    for layer, names in enumerate(backend.package.layers):
        for role in pages.roles:
            spec = binding.inputs[names[role]]
            t = pages.layers[layer][role]
            assert (spec["device"], spec["ptr"], spec["shape"]) == ("cuda", t.data_ptr(), tuple(t.shape))
    first = list(binding.log)
    drive(backend, pool, REQUESTS)
    later = binding.log[len(first):]
    assert not [e for e in later if e[1] in pool_names], "pools are rebound during steps"
    assert {e[2] for e in binding.log} == {"cuda"}, "something was bound from host memory"
    assert not [e for e in binding.log if e[0] in ("bind_cpu_input", "bind_ortvalue_input")]


def test_device_path_matches_the_cpu_path_and_writes_pages_on_the_device(make, monkeypatch):
    cpu, cpu_pool, _ = make("cpu", ort=fake_ort())
    gpu, gpu_pool, _ = make("cuda", selected_pages=True)
    moved = []  # (data_ptr, bytes) of every tensor copied to the host
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: (
        moved.append((self.data_ptr(), self.numel() * self.element_size())), real_cpu(self, *a, **k))[1])
    want, got = drive(cpu, cpu_pool, REQUESTS), drive(gpu, gpu_pool, REQUESTS)
    assert [s[0] for s in got] == [s[0] for s in want]
    for (_, a, *_), (_, b, *_) in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-6)
    pools = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for layer in gpu._device.pages.layers for t in layer.values()]
    assert moved and not [p for p, _ in moved if any(lo <= p < hi for lo, hi in pools)], "a pool was copied to host"
    # same pages, same contents: the device writes are the host pool's write_batch
    assert np.array_equal(cpu_pool._num_valid, gpu_pool._num_valid)
    for page in range(cpu_pool.num_pages):
        if cpu_pool._num_valid[0, page]:
            for layer in range(LAYERS):
                for a, b in zip(cpu_pool.storage.read_page(layer, page), gpu_pool.storage.read_page(layer, page)):
                    np.testing.assert_array_equal(a, b)
    assert gpu.transfer.device == "cuda" and cpu.transfer.device == "cpu"
    assert cpu.transfer.total_h2d == cpu.transfer.total_d2h == 0 and cpu.transfer.total_fed > 0


@pytest.mark.parametrize("pages", [48, 480])
def test_transfer_per_decode_step_is_o_new_tokens_not_o_pool(make, pages):
    """64 decode steps of one sequence: the bytes up are the same every step except the
    page table's 4 bytes per page of context; the bytes down are the logits only; a
    pool ten times larger moves exactly the same bytes."""
    backend, pool, _ = make("cuda", pages=pages)
    steps = [s for s in drive(backend, pool, {"a": ([1, 2, 3, 4, 5], 65)}) if s[0] == "decode"]
    assert len(steps) == 64
    pool_bytes = sum(t.numel() * t.element_size() for layer in backend._device.pages.layers for t in layer.values())
    rest = set()
    for _, _, h2d, d2h, (b, width) in steps:
        assert h2d["page_table"] == b * width * 4
        rest.add(tuple(sorted((k, v) for k, v in h2d.items() if k != "page_table")))
        assert d2h == {"logits": b * VOCAB * 4}
        assert sum(h2d.values()) < pool_bytes / 20
    assert len(rest) == 1, f"per-step uploads grow with the context: {rest}"
    assert dict(next(iter(rest))) == dict(input_ids=4, position_ids=4, past_lens=4, token_budget=4, logits_index=8,
                                          write_slots=3 * 8, touched_pages=2 * 8)
    assert backend.transfer.total_h2d >= sum(sum(s[2].values()) for s in steps)
    stats = backend.transfer.stats()
    assert stats["transfer_d2h_bytes_last_step"] == VOCAB * 4 and stats["transfer_h2d_bytes"] > 0


@pytest.mark.parametrize("cold_tier", [COLD_TIER, {**COLD_TIER, "cold_format": "int4", "group_size": 2}],
                         ids=["int8", "int4"])
def test_cold_tier_on_the_device_reads_the_same_as_on_the_host(make, cold_tier):
    cpu, cpu_pool, cpu_ort = make("cpu", tiered=True, ort=fake_ort(), cold_tier=cold_tier)
    gpu, gpu_pool, gpu_ort = make("cuda", tiered=True, cold_tier=cold_tier)
    if cold_tier.get("cold_format") == "int4":  # the device pools are what the session declares
        layer = gpu_pool.cache_inputs(0)  # the attached DevicePages
        assert layer["key_cache_int8"].dtype == torch.uint8 and layer["key_scale"].dtype == torch.float16
    want, got = drive(cpu, cpu_pool, REQUESTS, demote=True), drive(gpu, gpu_pool, REQUESTS, demote=True)
    assert gpu_pool.num_cold_free < 48 and gpu_pool.num_cold_free == cpu_pool.num_cold_free
    for (_, a, *_), (_, b, _, d2h, (rows, width)) in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-6)
        # a tiered pool needs the selections (hotness policy): they come down too, and only they
        assert d2h == {"logits": rows * VOCAB * 4, **{f"selected_pages.{i}": rows * HEADS * width
                                                      for i in range(LAYERS)}}
    np.testing.assert_allclose(gpu_ort.sessions[0].last_context, cpu_ort.sessions[0].last_context, rtol=1e-6)


def test_kernel_writer_writes_the_same_pages(make, monkeypatch):
    from tests.runtime.trt_fakes import _appended, _fake_append

    monkeypatch.setattr("tinyserve_trt.cuda.library.append_kv", _fake_append)
    monkeypatch.setattr("tinyserve_trt.cuda.library.load", lambda path=None: "fake-lib")
    _appended.clear()
    ref, ref_pool, _ = make("cuda")
    kern, kern_pool, _ = make("cuda", pages=48)
    kern._device.use_kernel = True
    want, got = drive(ref, ref_pool, REQUESTS), drive(kern, kern_pool, REQUESTS)
    assert _appended
    for (_, a, *_), (_, b, *_) in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-6)
    assert np.array_equal(ref_pool._num_valid, kern_pool._num_valid)
    ref_pool.check_integrity()
    kern_pool.check_integrity()


# ---- which provider, which model, which options -------------------------------------------
def _model_with_function(path):
    """A model whose one node is a model-local function (as the exporter's op is)."""
    import onnx
    from onnx import TensorProto, helper

    fn = helper.make_function("tinyserve", "Twice", ["x"], ["y"], [helper.make_node("Add", ["x", "x"], ["y"])],
                              [helper.make_opsetid("", 17)])
    graph = helper.make_graph([helper.make_node("Twice", ["a"], ["b"], domain="tinyserve")], "g",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, functions=[fn], opset_imports=[helper.make_opsetid("", 17),
                                                                    helper.make_opsetid("tinyserve", 1)])
    onnx.save(model, str(path))


def test_cuda_ep_gets_the_inlined_model_cached_beside_the_package(make, tmp_path):
    import onnx

    _model_with_function(tmp_path / "model.onnx")
    backend, _, ort = make("cuda", inline=True)
    model, providers = ort.attempts[0]
    assert model == str(tmp_path / "model.inlined.onnx") and len(ort.attempts) == 1
    assert [p[0] if isinstance(p, tuple) else p for p in providers] == ["CUDAExecutionProvider",
                                                                         "CPUExecutionProvider"]
    inlined = onnx.load(model)
    assert not inlined.functions and [n.op_type for n in inlined.graph.node] == ["Add"]
    stamp = (tmp_path / "model.inlined.onnx").stat().st_mtime_ns
    make("cuda", inline=True)  # cached: not rewritten
    assert (tmp_path / "model.inlined.onnx").stat().st_mtime_ns == stamp


def test_tensorrt_ep_gets_the_plugin_and_the_model_as_exported(make, tmp_path, monkeypatch):
    plugin = tmp_path / "libtinyserve_trt_plugin.so"
    plugin.write_bytes(b"")
    monkeypatch.setenv("TINYSERVE_TRT_PLUGIN", str(plugin))
    backend, _, ort = make("tensorrt", inline=True)
    model, providers = ort.attempts[0]
    assert model == str(tmp_path / "model.onnx")  # not inlined: TensorRT must see the op node
    name, options = providers[0]
    assert name == "TensorrtExecutionProvider" and options["trt_extra_plugin_lib_paths"] == str(plugin)
    assert [p[0] if isinstance(p, tuple) else p for p in providers[1:]] == ["CUDAExecutionProvider",
                                                                             "CPUExecutionProvider"]
    assert backend.transfer.device == "cuda" and backend._device is not None


def test_missing_pieces_and_refused_sessions_are_one_line_errors(make, tmp_path, monkeypatch):
    monkeypatch.setenv("TINYSERVE_TRT_PLUGIN", str(tmp_path / "absent.so"))
    with pytest.raises(RuntimeError, match="plugin library not found"):
        make("tensorrt")
    with pytest.raises(RuntimeError, match="install onnxruntime-gpu"):
        make("cuda", ort=fake_ort())
    ort = fake_ort(GPU, "GPU", fail_on=("CUDAExecutionProvider",))
    with pytest.raises(RuntimeError) as err:
        make("cuda", ort=ort, inline=False)
    message = str(err.value)
    assert "\n" not in message and "#27873" in message and "inline_local_functions" in message
    assert len(ort.attempts) == 1 and not ort.sessions  # no silent CPU fallback
    backend, _, _ = make("auto", ort=fake_ort())  # no GPU: auto is the CPU EP, pages stay on the host
    assert backend.provider == "cpu" and backend._device is None
    backend, _, _ = make("auto")  # onnxruntime-gpu sees a GPU and torch has CUDA: pages on the GPU
    assert backend.provider == "cuda" and backend._device is not None
    with pytest.raises(ValueError, match="ort provider must be one of"):
        make("gpu")


def test_engine_config_and_cli_take_the_provider():
    from tinyserve_trt.runtime.cli import build_parser
    from tinyserve_trt.runtime.config import EngineConfig

    assert EngineConfig(ort_provider="cuda").ort_provider == "cuda"
    with pytest.raises(ValueError, match="ort_provider must be one of"):
        EngineConfig(ort_provider="gpu")
    args = build_parser().parse_args(["generate", "pkg", "--prompt-ids", "1", "--ort-provider", "tensorrt"])
    assert args.ort_provider == "tensorrt"
    assert build_parser().parse_args(["serve", "pkg"]).ort_provider == "auto"


def test_engine_stats_report_transfers_on_the_cpu_ep(llama):
    """The real CPU EP: honest zeros for device transfers, and the bytes fed to ORT."""
    from tinyserve_trt.runtime.llm import LLM

    _, pkg, _ = llama
    llm = LLM(pkg, ort_provider="cpu", max_batch=2, threads=1)
    llm.generate(prompt_token_ids=[[1, 2, 3, 4, 5]], params=SamplingParams(temperature=0, max_tokens=4))
    stats = llm.stats()
    llm.close()
    assert stats["transfer_device"] == "cpu" and stats["transfer_h2d_bytes"] == stats["transfer_d2h_bytes"] == 0
    assert stats["transfer_fed_bytes"] > 0 and stats["transfer_h2d_bytes_last_step"] == 0
