"""LLM / AsyncLLM / package behaviour on the tiny LLaMA package: text, stop strings,
streaming, cancellation, chat template, errors."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys

import pytest

from tinyserve_trt import LLM, AsyncLLM, SamplingParams
from tinyserve_trt.runtime.backends import BACKENDS, make_backend
from tinyserve_trt.runtime.model_package import ModelPackage, PackageError

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama):
    return LLM(llama[1], dense=True)


def test_text_prompt_round_trip_and_stop_string(llm):
    (out,) = llm.generate(["Hello"], GREEDY)
    full = out.outputs[0]
    assert out.prompt == "Hello" and out.prompt_token_ids == llm.package.encode("Hello")
    assert full.text == llm.package.decode(full.token_ids) and full.finish_reason == "length"
    stop = full.text[5:7]
    assert stop and stop not in full.text[:5 + len(stop) - 1]
    (cut,) = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))
    c = cut.outputs[0]
    assert c.text == full.text[:full.text.index(stop)] and c.finish_reason == "stop"
    assert full.token_ids[:len(c.token_ids)] == c.token_ids and len(c.token_ids) < 24
    assert llm.stats()["pages_in_use"] == 0


def test_stream_deltas_add_up_and_early_close_frees_pages(llm):
    (ref,) = llm.generate(prompt_token_ids=[[5, 6, 7, 8, 9]], params=GREEDY)
    chunks = list(llm.stream(prompt_token_ids=[5, 6, 7, 8, 9], params=GREEDY))
    assert [t for c in chunks for t in c.outputs[0].delta_token_ids] == ref.outputs[0].token_ids
    assert "".join(c.outputs[0].delta_text for c in chunks) == ref.outputs[0].text
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    it = llm.stream("abc", GREEDY)
    next(it)
    assert llm.stats()["pages_in_use"] > 0
    it.close()
    assert llm.stats()["pages_in_use"] == 0 and not llm.engine.has_unfinished()


def test_n_samples_and_per_request_params(llm):
    outs = llm.generate(prompt_token_ids=[[3, 4, 5], [9, 9]], params=[
        SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)])
    assert [o.index for o in outs[0].outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 4 for o in outs[0].outputs) and len(outs[1].outputs[0].token_ids) == 2
    assert outs[0].stats.ttft is not None and outs[0].stats.tokens_per_s > 0


def test_chat_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=3))
    assert out.prompt == "<user>hi\n<assistant>"


def test_bad_requests_raise_value_error(llm):
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        llm.generate(prompt_token_ids=[[1, 300]])
    with pytest.raises(ValueError, match="exactly one"):
        llm.generate()
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(["a", "b"], [GREEDY])
    with pytest.raises(ValueError, match="token_budget"):
        LLM(llm.package, token_budget=-1)
    assert not llm.engine.has_unfinished()


def test_async_llm_concurrent_requests_match_llm_and_abort(llm, llama):
    prompts = [[5, 6, 7, 8, 9], list(range(30, 60))]
    want = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, params=GREEDY)]

    async def main():
        engine = AsyncLLM(llama[1], dense=True)

        async def one(p):
            got = []
            async for r in engine.generate(prompt_token_ids=p, params=GREEDY):
                got += r.outputs[0].delta_token_ids
            assert r.finished
            return got

        try:
            got = await asyncio.gather(*(one(p) for p in prompts))
            agen = engine.generate(prompt_token_ids=prompts[1], params=SamplingParams(max_tokens=500))
            await agen.__anext__()
            await agen.aclose()
            for _ in range(100):
                if not engine.engine.has_unfinished():
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(ValueError):
                async for _ in engine.generate(prompt_token_ids=[999]):
                    pass
            return got, engine.stats()["pages_in_use"]
        finally:
            engine.shutdown()

    got, in_use = asyncio.run(main())
    assert got == want and in_use == 0


def test_package_errors(tmp_path, llama):
    with pytest.raises(PackageError, match="not a directory"):
        ModelPackage.load(tmp_path / "missing")
    with pytest.raises(PackageError, match="tinyserve.json"):
        ModelPackage.load(tmp_path)
    bad = tmp_path / "bad"
    shutil.copytree(llama[1], bad)
    manifest = json.loads((bad / "tinyserve.json").read_text())
    manifest["head_dim"] = 0
    (bad / "tinyserve.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match="head_dim"):
        ModelPackage.load(bad)
    (bad / "model.onnx").unlink()
    with pytest.raises(PackageError, match="model.onnx"):
        ModelPackage.load(bad)


def test_backend_registry(llama):
    assert set(BACKENDS) >= {"ort", "trt"}
    with pytest.raises(ValueError, match="unknown backend"):
        make_backend("nope", None, None)
    # without TensorRT (our CI) the trt backend says what is missing in one line
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here")
    except Exception:
        pass
    with pytest.raises(RuntimeError, match="TensorRT is not installed"):
        LLM(llama[1], backend="trt")


def test_import_stays_light():
    code = ("import sys, tinyserve_trt; assert 'onnxruntime' not in sys.modules; "
            "assert 'tinyserve_trt.runtime' not in sys.modules; tinyserve_trt.LLM; "
            "assert tinyserve_trt.SamplingParams().max_tokens == 16; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_ort_backend_loads_the_exporters_optimized_copy(llama):
    import onnxruntime as ort

    package = ModelPackage.load(llama[1])
    assert package.ort_model_path(ort.__version__).name == "model.ort.onnx"
    assert package.ort_model_path("0.0.0") == package.model_path  # another ORT: the portable model
