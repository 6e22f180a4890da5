"""The paged runtime against the ORIGINAL export driven by ORT with its own cache.

Dense budget: greedy ids must be identical. Then runtime features that must not
change a token: prefix sharing, batching, chunked prefill, preemption.
"""

from __future__ import annotations

import pytest

from tests.conftest import ARCHS
from tests.tiny_models import original_greedy
from tinyserve_trt import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
PROMPTS = [list(range(7, 12)), [(i * 37 + 11) % 256 for i in range(23)], [(i * 91 + 5) % 256 for i in range(41)]]


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_dense_greedy_equals_original_export(tiny_packages, arch):
    src, pkg, manifest = tiny_packages(arch)
    llm = LLM(pkg, dense=True)
    for prompt in PROMPTS[:2]:
        (out,) = llm.generate(prompt_token_ids=[prompt], params=GREEDY)
        assert out.outputs[0].token_ids == original_greedy(src, manifest["source_io"], prompt, 32)


def test_batch_of_different_lengths_equals_each_alone(llama):
    _, pkg, _ = llama
    for dense in (True, False):
        llm = LLM(pkg, dense=dense, prefix_sharing=False)
        alone = [ids(llm.generate(prompt_token_ids=[p], params=GREEDY))[0] for p in PROMPTS]
        assert ids(llm.generate(prompt_token_ids=PROMPTS, params=GREEDY)) == alone


def test_prefix_sharing_on_and_off_agree(llama):
    _, pkg, _ = llama
    prefix = [(i * 13 + 3) % 256 for i in range(26)]  # 6 full pages of 4 + 2 tokens
    prompts = [prefix + [200, 201, 202], prefix + [17], prefix]
    results = {}
    for sharing in (True, False):
        llm = LLM(pkg, prefix_sharing=sharing)
        outs = [llm.generate(prompt_token_ids=[p], params=GREEDY)[0] for p in prompts]
        results[sharing] = ids(outs)
        reused = [o.stats.prefix_pages_reused for o in outs]
        if sharing:
            assert reused == [0, 6, 6] and llm.stats()["prefix_hit_rate"] > 0.5
        else:
            assert reused == [0, 0, 0] and llm.stats()["prefix_hit_rate"] == 0
    assert results[True] == results[False]


def test_chunked_prefill_and_preemption_do_not_change_tokens(llama):
    _, pkg, _ = llama
    reference = ids(LLM(pkg, dense=True).generate(prompt_token_ids=PROMPTS, params=GREEDY))
    chunked = LLM(pkg, dense=True, prefill_chunk=4, max_tokens_per_step=16)
    assert ids(chunked.generate(prompt_token_ids=PROMPTS, params=GREEDY)) == reference
    page_bytes = 2 * (2 * 2 * 4 * 16 + 2 * 2 * 16) * 4  # layers * (K+V pages + min/max) * fp32
    tight = LLM(pkg, dense=True, memory=20 * page_bytes, prefix_sharing=False)  # 20 pages: one long sequence
    assert ids(tight.generate(prompt_token_ids=PROMPTS, params=GREEDY)) == reference
    assert tight.stats()["preemptions"] > 0


def kept_pages_range(manifest, pages: int) -> tuple[float, float]:
    """Pages a KV head reads when each selection keeps ``pages``: exactly that for one selection per
    group, between that and G times it for per-query-head selection (the heads' union)."""
    get = manifest.get if isinstance(manifest, dict) else lambda k: getattr(manifest, k)
    G = get("num_heads") // get("num_kv_heads")
    return float(pages), float(pages * (G if get("group_reduce") == "head" else 1))


def test_sparse_budget_selects_fewer_pages_and_runs(llama):
    _, pkg, manifest = llama
    prompt = [(i * 7 + 1) % 256 for i in range(80)]  # 20 pages of 4
    sparse = LLM(pkg, token_budget=16)  # 4 pages per decode step on the sparse layer
    (out,) = sparse.generate(prompt_token_ids=[prompt], params=SamplingParams(temperature=0, max_tokens=8,
                                                                               ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 8
    G = manifest["num_heads"] // manifest["num_kv_heads"]
    if manifest["group_reduce"] == "head":  # each query head keeps 4; a KV head reads their union
        assert 4.0 <= out.stats.pages_selected_per_step <= 4.0 * G
        assert sparse.stats()["page_selection_rate"] < 0.25 * G
    else:
        assert out.stats.pages_selected_per_step == pytest.approx(4.0)
        assert sparse.stats()["page_selection_rate"] < 0.25
    (dense,) = LLM(pkg, dense=True).generate(prompt_token_ids=[prompt], params=SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True))
    assert dense.stats.pages_selected_per_step > 20
    assert manifest["dense_layers"] == 1  # the other layer is sparse: what the stats average over


def test_prefix_cache_hit_does_not_change_sparse_outputs(llama):
    """After a prefix-cache hit the last prompt token runs alone; it must attend densely like a
    full prefill, so the answer (and its logprobs) do not depend on what was cached."""
    _, pkg, _ = llama
    prompt = [(i * 5 + 3) % 256 for i in range(37)]  # 9 full pages of 4 + 1 token
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    llm = LLM(pkg, token_budget=16, sparse_min_ratio=0)  # sparse from the first decode step
    cold, warm = (llm.generate(prompt_token_ids=[prompt], params=params)[0] for _ in range(2))
    assert warm.stats.prefix_tokens_reused == 36
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert warm.outputs[0].logprobs == pytest.approx(cold.outputs[0].logprobs, abs=1e-5)


def test_sparse_decode_is_independent_of_a_concurrent_prefill(llama):
    """A decode row batched with another request's prefill chunk must still decode sparsely:
    the op makes a step with more than one new token per row dense for every row, so the
    scheduler never puts decode rows and prefill chunks into one batch."""
    from tinyserve_trt.runtime.config import EngineConfig
    from tinyserve_trt.runtime.engine import Engine
    from tinyserve_trt.runtime.model_package import ModelPackage

    package = ModelPackage.load(llama[1])
    prompt = [(i * 7 + 1) % 256 for i in range(80)]  # 20 pages of 4; budget 16 keeps 4
    other = [(i * 11 + 5) % 256 for i in range(60)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)

    def decode(with_other: bool):
        engine = Engine(package, EngineConfig(token_budget=16, prefill_chunk=4, max_tokens_per_step=16,
                                              prefix_sharing=False))
        seq = engine.add_request("a", prompt, params)
        while seq.num_output_tokens < 2:
            engine.step()
        if with_other:  # arrives mid-decode: its 15 prefill chunks overlap a's decode steps
            engine.add_request("b", other, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        stats = seq.stats.pages_selected
        engine.close()
        return seq.output_token_ids, seq.output_logprobs, stats

    alone, together = decode(False), decode(True)
    assert together[0] == alone[0]
    assert together[1] == pytest.approx(alone[1], abs=1e-5)
    lo, hi = kept_pages_range(package.spec, 4)  # every decode step of the sparse layer kept 4 pages (per head)
    assert lo <= min(together[2]) and max(together[2]) <= hi


def test_short_contexts_decode_dense_until_sparse_min_ratio(llama):
    """sparse_min_ratio: a sequence decodes dense - exactly the dense run's greedy ids, every
    page attended - while its context is below ratio x budget, and selects from there on."""
    from tinyserve_trt.runtime.config import EngineConfig
    from tinyserve_trt.runtime.engine import Engine
    from tinyserve_trt.runtime.model_package import ModelPackage

    package = ModelPackage.load(llama[1])
    prompt = PROMPTS[1]  # 23 tokens: decode contexts 24 .. 39
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (dense,) = ids(LLM(package, dense=True).generate(prompt_token_ids=[prompt], params=params))
    (sparse,) = ids(LLM(package, token_budget=16, sparse_min_ratio=0).generate(prompt_token_ids=[prompt],
                                                                                params=params))

    def run(ratio):
        engine = Engine(package, EngineConfig(token_budget=16, sparse_min_ratio=ratio))
        seq = engine.add_request("a", prompt, params)
        while engine.has_unfinished():
            engine.step()
        engine.close()
        return seq.output_token_ids, seq.stats.pages_selected  # per decode step, mean over sparse layers

    always_dense, selected = run(100.0)
    assert always_dense == dense
    past = range(len(prompt), len(prompt) + len(selected))  # cached tokens at each decode step
    assert selected == [-(-p // 4) for p in past]  # every written page of 4
    crossing, selected = run(2.0)  # dense while context (past + 1) < 32, then 16 tokens = 4 pages
    lo, hi = kept_pages_range(package.spec, 4)
    assert [x for x, p in zip(selected, past) if p + 1 < 32] == [-(-p // 4) for p in past if p + 1 < 32]
    assert all(lo <= x <= min(hi, -(-p // 4)) for x, p in zip(selected, past) if p + 1 >= 32)
    assert crossing[:8] == dense[:8]  # the first 8 tokens come from dense steps
    assert sparse != dense  # (the budget does change this prompt's tokens: the rule is not a no-op)
