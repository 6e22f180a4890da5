"""TrtBackend over a TieredPagePool (INT8 cold pages), against the stand-in engine on CPU.

Every full page but a sequence's last is demoted after each step. The toy model
reads each row's cached keys through the page table it is fed; what it read must be
the exact keys for hot pages and their INT8 round trip for cold ones - so a handle
fed instead of a physical id, an unbound cold pool or a demotion that quantized the
wrong page shows up as a wrong sum.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.runtime.trt_fakes import (COLD_TIER, DIM, HEADS, LAYERS, PAGE_SIZE, PAGES, REQUESTS,  # noqa: E402
                                     fake_backend, require_trt_gpu)  # noqa: F401
from tinyserve_trt.contracts.cold_tier import tier_codec  # noqa: E402
from tinyserve_trt.ops.cold_codec import page_bounds  # noqa: E402
from tinyserve_trt.runtime.config import SchedulerConfig  # noqa: E402
from tinyserve_trt.runtime.sampling import SamplingParams  # noqa: E402
from tinyserve_trt.runtime.scheduler import Scheduler  # noqa: E402


def _toy_page_keys(tokens: list[int], page: int, layer: int) -> np.ndarray:
    """``[HEADS, PAGE_SIZE, DIM]`` keys the fake engine computed for a full logical page."""
    pos = np.arange(page * PAGE_SIZE, (page + 1) * PAGE_SIZE)
    ids = np.asarray(tokens, np.float32)[pos]
    grid = 0.5 * np.arange(HEADS)[:, None, None] + 0.125 * np.arange(DIM)
    return ((ids + 0.25 * pos + layer)[None, :, None] + grid).astype(np.float32)


@pytest.mark.parametrize("cold_tier", [COLD_TIER, {**COLD_TIER, "cold_format": "int4", "group_size": 2},
                                       {**COLD_TIER, "cold_format": "int4", "group_size": 2, "int8_layers": [1]}],
                         ids=["int8", "int4", "int4-int8-layer-1"])
def test_cold_pages_are_bound_addressed_physically_and_quantized_on_the_device(fake_backend, cold_tier):
    """A tiered pool: every full page but a sequence's last is demoted after each step.
    The toy model reads each row's cached keys through the page table; what it read
    must be the exact keys for hot pages and their INT8 / INT4 round trip (the package's
    ColdCodec) for cold ones."""
    codecs = [tier_codec(cold_tier, layer) for layer in range(LAYERS)]  # int8_layers: INT8 in an int4 package
    backend, pool = fake_backend(tiered=True, cold_tier=cold_tier)
    assert [backend.pages.layers[i]["key_cache_int8"].dtype == torch.int8 for i in range(LAYERS)] == \
        [c.cold_format == "int8" for c in codecs]
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
                        codec = codecs[layer]
                        keys = codec.dequantize_keys(*codec.quantize(keys, "k"), *page_bounds(keys))
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


def test_a_pool_larger_than_the_engine_profile_is_refused_in_one_line(fake_backend):
    fake_backend(tiered=True, max_pool_pages=PAGES, max_cold_pages=PAGES)  # fits exactly
    with pytest.raises(RuntimeError, match=f"needs {PAGES} cold pages but the engine was built for at most 8"):
        fake_backend(tiered=True, max_pool_pages=PAGES, max_cold_pages=8)
    with pytest.raises(RuntimeError, match=f"needs {PAGES} pool pages but the engine was built for at most 10"):
        fake_backend(max_pool_pages=10)


# ---- on a GPU with TensorRT -------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.trt
def test_gpu_cold_tier_engine_agrees_with_ort(tiny_root):
    """A tiny LLaMA exported for TensorRT with a cold tier: at 10% hot, the engine demotes
    pages and its greedy tokens stay close to ONNX Runtime's on the same package."""
    require_trt_gpu()
    from tests.tiny_models import export_source
    from tinyserve_trt import LLM
    from tinyserve_trt.export.config import ExportConfig
    from tinyserve_trt.export.pipeline import export_model

    root = tiny_root / "trt-cold"
    root.mkdir(exist_ok=True)
    pkg = root / "pkg"
    export_model(export_source("llama", root / "src"), pkg, ExportConfig(
        page_size=4, token_budget=16, dense_layers=1, backend="trt", cold_pages=True, max_context=256), quiet=True)
    prompts = [[(i * 7 + 1) % 256 for i in range(80)], [(i * 37 + 11) % 256 for i in range(41)]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens, demoted = {}, {}
    for backend in ("ort", "trt"):
        # sparse_min_ratio 0: both prompts decode sparse (the cold pages' selection path) from the start
        llm = LLM(pkg, backend=backend, hot_fraction=0.1, prefix_sharing=False, sparse_min_ratio=0)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, params=params)]
        demoted[backend] = llm.stats()["pages_demoted"]
    same = [a == b for x, y in zip(tokens["ort"], tokens["trt"]) for a, b in zip(x, y)]
    assert demoted["trt"] > 0 and np.mean(same) >= 0.8, (demoted, np.mean(same))
