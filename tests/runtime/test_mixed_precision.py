"""The engine over hot/cold mixed-precision pages (issue #6), on a tiny LLaMA exported with a cold tier.

Hot fraction 1.0 must not change a token against the plain package; a low one
must really demote pages, keep the pool consistent after every step, and keep
greedy output close. The token agreement measured here is printed (``-s``).
"""

from __future__ import annotations

import numpy as np
import pytest

from tinyserve_trt import LLM, SamplingParams
from tinyserve_trt.runtime.config import EngineConfig
from tinyserve_trt.runtime.tiers import TieredPagePool

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
PROMPTS = [[(i * 7 + 1) % 256 for i in range(80)], [(i * 37 + 11) % 256 for i in range(23)],
           [(i * 91 + 5) % 256 for i in range(61)]]


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def run_checked(llm: LLM, prompts, params=GREEDY) -> tuple[list[list[int]], int]:
    """Generate step by step, checking pool and scheduler integrity (with page data) after every
    step; returns the tokens and the most cold pages seen at once."""
    engine = llm.engine
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    most_cold = 0
    while engine.has_unfinished():
        engine.step()
        holders = [s.pages for s in engine.scheduler.running]
        engine.scheduler.check_integrity()
        engine.pool.check_integrity(holders, check_data=True)
        most_cold = max(most_cold, len(engine.pool.cold_pages()))
    return [s.output_token_ids for s in seqs], most_cold


def test_config_knobs_are_validated():
    for bad in (dict(hot_fraction=1.5), dict(hot_fraction=True), dict(hot_pages=-1), dict(hot_decay=0.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)


def test_tiered_pool_comes_from_the_package(llama_cold):
    _, pkg, manifest = llama_cold
    engine = LLM(pkg, max_batch=4, hot_fraction=0.25).engine
    assert isinstance(engine.pool, TieredPagePool)
    assert engine.tiering.hot_config.hot_fraction == 0.25
    assert engine.tiering.hot_config.recent_pages == manifest["cold_tier"]["recent_pages"]
    assert engine.pool.num_cold >= 1 and engine.pool.num_hot < engine.pool.num_pages
    default = LLM(pkg, max_batch=4).engine  # the calibrated hot fraction
    assert default.tiering.hot_config.hot_fraction == manifest["cold_tier"]["hot_fraction"]


@pytest.mark.parametrize("dense", [False, True])
def test_hot_fraction_one_equals_the_plain_engine(llama, llama_cold, dense):
    plain = ids(LLM(llama[1], dense=dense, prefix_sharing=False).generate(prompt_token_ids=PROMPTS, params=GREEDY))
    llm = LLM(llama_cold[1], dense=dense, prefix_sharing=False, hot_fraction=1.0)
    tokens, most_cold = run_checked(llm, PROMPTS)
    assert tokens == plain and most_cold == 0 and llm.stats()["pages_demoted"] == 0


def test_plain_pool_reads_a_cold_tier_package(llama, llama_cold):
    plain = ids(LLM(llama[1]).generate(prompt_token_ids=PROMPTS, params=GREEDY))
    llm = LLM(llama_cold[1], kv_tiers=False)
    assert not isinstance(llm.engine.pool, TieredPagePool)
    assert ids(llm.generate(prompt_token_ids=PROMPTS, params=GREEDY)) == plain


def test_low_hot_fraction_demotes_and_stays_close(llama_cold):
    _, pkg, _ = llama_cold
    reference, _ = run_checked(LLM(pkg, prefix_sharing=False, hot_fraction=1.0), PROMPTS)
    llm = LLM(pkg, prefix_sharing=False, hot_fraction=0.1)
    tokens, most_cold = run_checked(llm, PROMPTS)
    stats = llm.stats()
    assert most_cold >= 15 and stats["pages_demoted"] >= most_cold
    assert stats["peak_kv_bytes"] < 0.8 * stats["peak_kv_bytes_all_hot"]
    same = [a == b for ref, got in zip(reference, tokens) for a, b in zip(ref, got)]
    agreement = float(np.mean(same))
    print(f"hot fraction 0.1: {stats['pages_demoted']} pages demoted (at most {most_cold} cold at once), "
          f"greedy token agreement {agreement:.3f} over {len(same)} tokens, peak KV bytes "
          f"{stats['peak_kv_bytes'] / stats['peak_kv_bytes_all_hot']:.2f} of all-hot")
    assert agreement >= 0.8


def test_prefix_sharing_with_cold_pages(llama_cold):
    """Cached pages go cold too; a later request reusing them reads them through the INT8 tier."""
    _, pkg, _ = llama_cold
    prefix = [(i * 13 + 3) % 256 for i in range(40)]
    llm = LLM(pkg, hot_fraction=0.1)
    first, _ = run_checked(llm, [prefix + [200, 201]])
    assert llm.engine.pool.cold_pages()  # the cached prefix went (partly) cold
    second, _ = run_checked(llm, [prefix + [17]])
    assert llm.stats()["prefix_hit_rate"] > 0.4 and len(second[0]) == GREEDY.max_tokens


def test_backend_rebinds_a_cold_pool_whose_buffer_changed(llama_cold):
    _, pkg, _ = llama_cold
    reference, _ = run_checked(LLM(pkg, prefix_sharing=False, hot_fraction=0.1), PROMPTS[:1])
    llm = LLM(pkg, prefix_sharing=False, hot_fraction=0.1)
    engine = llm.engine
    seq = engine.add_request("r", PROMPTS[0], GREEDY)
    engine.step()  # prefill: pages demoted into the cold tier
    pool = engine.pool
    store = pool.storage
    store._kq, store._vq = store._kq.copy(), store._vq.copy()  # as a pool that grew its cold tier would
    while engine.has_unfinished():
        engine.step()
    name = engine.package.layers[0]["key_cache_int8"]
    assert engine.backend._pool_values[name][0][0] == pool.k_pages_int8(0).__array_interface__["data"][0]
    assert seq.output_token_ids == reference[0] and engine.stats()["pages_demoted"] > 0


def test_tiered_engine_refuses_a_backend_without_cold_pages(llama_cold, monkeypatch):
    from tinyserve_trt.runtime.backends.ort import OrtBackend

    monkeypatch.setattr(OrtBackend, "reads_cold_pages", False)
    with pytest.raises(ValueError, match="cannot read INT8 cold pages"):
        LLM(llama_cold[1])


def test_static_scales_come_from_the_package_calibration(llama_cold, tmp_path):
    from tinyserve_trt.contracts.calibration import CalibrationArtifact

    _, pkg, manifest = llama_cold
    with pytest.raises(ValueError, match="kv_scales"):
        EngineConfig(kv_scales="fixed")
    reference, _ = run_checked(LLM(pkg, prefix_sharing=False, hot_fraction=1.0), PROMPTS)
    llm = LLM(pkg, prefix_sharing=False, hot_fraction=0.1, kv_scales="static")
    tokens, most_cold = run_checked(llm, PROMPTS)
    pool = llm.engine.pool
    k_static, v_static = CalibrationArtifact.load(pkg / manifest["cold_tier"]["calibration"]["file"]).static_scales()
    assert most_cold > 0 and pool.tiers.scales == "static"
    for page in pool.cold_pages():
        c = pool.physical(page) - pool.num_hot
        np.testing.assert_array_equal(pool.k_scale(0)[c], k_static[0])  # K per channel
        np.testing.assert_array_equal(pool.v_scale(2)[c], np.broadcast_to(v_static[2], pool.v_scale(2)[c].shape))
    same = [a == b for ref, got in zip(reference, tokens) for a, b in zip(ref, got)]
    print(f"static scales, hot fraction 0.1: greedy token agreement {np.mean(same):.3f} over {len(same)} tokens")
    assert len(same) == GREEDY.max_tokens * len(PROMPTS)  # the tiny model's ranges are random: no accuracy claim


def test_static_scales_need_a_calibrated_package(llama, tmp_path):
    from tinyserve_trt.export.config import ExportConfig
    from tinyserve_trt.export.pipeline import export_model

    pkg = tmp_path / "pkg"
    export_model(llama[0], pkg, ExportConfig(page_size=4, token_budget=16, dense_layers=1, cold_pages=True,
                                             validate=False, cold_format="int8"), quiet=True)
    with pytest.raises(ValueError, match="static KV scales need a package exported with --calibration"):
        LLM(pkg, kv_scales="static")
    assert LLM(pkg).engine.pool.tiers.scales == "dynamic"


def test_int4_two_level_package_quantizes_each_layer_as_its_node_reads(llama, tmp_path):
    """A two-level INT4 package (format 3): the sparse layers' nodes read key_sub_bounds and their cold
    keys quantize on the sub-page codes; the dense layers' nodes do not, and theirs on the page bounds.
    The pool takes that split from the manifest; the engine runs with the pool checked every step."""
    from tinyserve_trt.export.config import ExportConfig
    from tinyserve_trt.export.pipeline import export_model

    src, _, manifest = llama
    pkg = tmp_path / "pkg"
    export_model(src, pkg, ExportConfig(page_size=4, token_budget=8, dense_layers=1, cold_pages=True,
                                        cold_format="int4", sub_page_size=2, validate=False,
                                        int8_layers="none"), quiet=True)  # every layer INT4: auto may pick either
    llm = LLM(pkg, max_batch=4, hot_fraction=0.25)
    layers = llm.engine.package.layers
    two_level = {i for i, layer in enumerate(layers) if "key_sub_bounds" in layer}
    assert two_level and len(two_level) < len(layers)  # both kinds of layer
    storage = llm.engine.pool.storage
    assert storage.two_level_layers == two_level
    assert [storage.keys_on_codes(i) for i in range(len(layers))] == [i in two_level for i in range(len(layers))]
    _, most_cold = run_checked(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert most_cold > 0
