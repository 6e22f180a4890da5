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

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.runtime.trt_fakes import (HEADS, LAYERS, VOCAB, REQUESTS, _appended, fake_backend,  # noqa: E402,F401
                                     greedy, require_trt_gpu, trt_backend)
from tinyserve_trt.runtime.backends.device_pages import HOT_ROLES  # noqa: E402
from tinyserve_trt.runtime.config import SchedulerConfig  # noqa: E402
from tinyserve_trt.runtime.sampling import SamplingParams  # noqa: E402
from tinyserve_trt.runtime.scheduler import Scheduler  # noqa: E402

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


def test_graphs_can_be_turned_off(fake_backend):  # EngineConfig.cuda_graphs=False passes this option
    backend, pool = fake_backend(cuda_graphs=False)
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


# ---- on a GPU with TensorRT -------------------------------------------------------------
@pytest.fixture(scope="module")
def trt_llama(tiny_root):
    require_trt_gpu()
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
