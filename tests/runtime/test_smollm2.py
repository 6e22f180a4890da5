"""The embedded SmolLM2-135M-Instruct: the runtime against its original export (slow)."""

from __future__ import annotations

import json

import pytest

from tests.tiny_models import original_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    pytest.importorskip("transformers")
    from tinyserve_trt.export.config import ExportConfig
    from tinyserve_trt.export.pipeline import export_model
    from tinyserve_trt.export.hf import smollm2 as source

    src = source.ensure_onnx()
    pkg = tmp_path_factory.mktemp("smollm2") / "pkg"
    export_model(src, pkg, ExportConfig(), quiet=True)
    return src, pkg, json.loads((pkg / "tinyserve.json").read_text())


def test_dense_greedy_equals_original_export(smollm2):
    """32 greedy tokens of a chat prompt, identical to the original export with its own cache."""
    from tinyserve_trt import LLM, SamplingParams

    src, pkg, manifest = smollm2
    llm = LLM(pkg, dense=True)
    prompt = llm.package.encode(llm.package.apply_chat_template(
        [{"role": "user", "content": "Name three colors of the rainbow."}]), add_special_tokens=False)
    (out,) = llm.generate(prompt_token_ids=[prompt], params=SamplingParams(temperature=0, max_tokens=32,
                                                                           ignore_eos=True))
    assert out.outputs[0].token_ids == original_greedy(src, manifest["source_io"], prompt, 32)


def test_capital_of_france(smollm2):
    from tinyserve_trt import LLM, SamplingParams

    llm = LLM(smollm2[1])  # the package's sparse budget: far above this context, so it reads every page
    (out,) = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=3))
    assert out.outputs[0].text.startswith(" Paris")


def test_prefix_from_the_disk_store_after_a_restart_equals_recomputation(smollm2, tmp_path):
    """Issue #33 on the real model: a prompt's pages written at close, read back by a new engine
    on the same directory; greedy ids identical to a full recomputation."""
    from tinyserve_trt import LLM, SamplingParams

    pkg = smollm2[1]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    text = "You are a careful assistant for a hardware store. " * 12 + "Which screws hold drywall?"
    fresh = LLM(pkg, dense=True, prefix_sharing=False)
    prompt = fresh.package.encode(text)
    (want,) = fresh.generate(prompt_token_ids=[prompt], params=params)
    fresh.close()
    for run in ("first", "restart"):
        llm = LLM(pkg, dense=True, kv_cache_dir=str(tmp_path))
        (got,) = llm.generate(prompt_token_ids=[prompt], params=params)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, run
        stats = llm.stats()
        llm.close()
    assert stats["prefix_pages_disk"] == (len(prompt) - 1) // llm.package.page_size > 0
