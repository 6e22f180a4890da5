"""LLM / AsyncLLM / package behaviour on the tiny LLaMA package: text, stop strings,
streaming, cancellation, chat template, errors."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys

import pytest

from tests.runtime.faults import poison_backend

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


# ---- bounds at the boundary (issue #19) ----------------------------------------------


@pytest.mark.parametrize("params, match", [
    (dict(token_budget=10**12), "token_budget"),  # was an int32 OverflowError inside the engine
    (dict(token_budget=2**31 - 1), "token_budget must be <= 8192"),  # int32-safe, still past the context
    (dict(n=1000), "^n "),
    (dict(temperature=float("inf")), "temperature"),
    (dict(stop_token_ids=[256]), r"stop_token_ids must be in \[0, 256\)"),
])
def test_llm_rejects_out_of_bounds_requests_before_queuing(llm, params, match):
    steps = llm.stats()["steps"]
    with pytest.raises(ValueError, match=match):
        # the good first request is not queued either: every request is checked first
        llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5]], params=[GREEDY, SamplingParams(max_tokens=2, **params)])
    assert not llm.engine.has_unfinished() and llm.stats()["pages_in_use"] == 0
    assert llm.stats()["steps"] == steps


def test_llm_rejects_an_engine_budget_past_the_context(llama):
    with pytest.raises(ValueError, match="token_budget must be <= 8192"):
        LLM(llama[1], token_budget=10**6)
    with pytest.raises(ValueError, match="token_budget must be <= 2147483647"):
        AsyncLLM(llama[1], token_budget=10**12)


def test_async_llm_rejects_before_queuing(llama):
    async def main():
        engine = AsyncLLM(llama[1], dense=True)
        try:
            with pytest.raises(ValueError, match="token_budget"):
                async for _ in engine.generate(prompt_token_ids=[1, 2], params=SamplingParams(token_budget=10**9)):
                    pass
            return engine.is_alive, engine.engine.has_unfinished()
        finally:
            engine.shutdown()

    assert asyncio.run(main()) == (True, False)


# ---- sampling defaults from the package (issue #13 item 6) ---------------------------------


def test_defaults_are_greedy_without_a_generation_config(llm):
    assert not (llm.package.path / "generation_config.json").exists()
    assert llm.default_params.temperature == 0
    prompt = [[5, 6, 7, 8]]
    a = llm.generate(prompt_token_ids=prompt)[0].outputs[0].token_ids
    b = llm.generate(prompt_token_ids=prompt)[0].outputs[0].token_ids
    greedy = llm.generate(prompt_token_ids=prompt, params=SamplingParams(temperature=0))[0].outputs[0].token_ids
    assert a == b == greedy


def test_defaults_follow_the_generation_config(tmp_path, llama):
    from tinyserve_trt.export.package import tokenizer_files
    from tinyserve_trt.runtime.generation_defaults import default_params, sampling_defaults

    pkg = tmp_path / "pkg"
    shutil.copytree(llama[1], pkg)
    (pkg / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1, "eos_token_id": 2}))
    assert pkg / "generation_config.json" in tokenizer_files(pkg / "model.onnx")  # the exporter copies it
    with LLM(pkg, dense=True) as sampled:
        p = sampled.default_params
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 50, 1.1)
    assert default_params(pkg, temperature=0.0, top_k=3).temperature == 0.0  # explicit wins
    (pkg / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert sampling_defaults(pkg) == {"temperature": 0.0}  # HF: no do_sample = greedy
    (pkg / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": -1}))
    with pytest.raises(ValueError, match="generation_config.json: temperature"):
        sampling_defaults(pkg)


# ---- a supervised engine (issue #19) ---------------------------------------------------


def test_a_failed_step_fails_its_requests_frees_their_pages_and_the_engine_goes_on(llama):
    from tinyserve_trt.runtime.engine import StepFailed

    with LLM(llama[1], dense=True) as llm:
        engine = llm.engine
        raised = poison_backend(engine, 99)
        engine.add_request("bad", [99, 1, 2, 3, 4, 5], GREEDY)
        with pytest.raises(StepFailed) as e:
            engine.step()
        assert e.value.request_ids == ("bad",) and "injected" in str(e.value) and len(raised) == 1
        engine.scheduler.check_integrity()
        assert not engine.has_unfinished() and engine.stats()["pages_in_use"] == 0
        assert engine.stats()["step_failures"] == 1
        out = llm.generate(prompt_token_ids=[[5, 6, 7]], params=GREEDY)  # the engine still serves
        assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens


async def tokens_or_error(engine, prompt):
    """Stream one greedy request to the end: its token count, or the RuntimeError it failed with."""
    try:
        async for r in engine.generate(prompt_token_ids=prompt, params=GREEDY):
            pass
        return len(r.outputs[0].token_ids)
    except RuntimeError as e:
        return e


def test_async_llm_fails_only_the_failed_batch_then_gives_up_after_repeated_failures(llama, caplog):
    async def main():
        engine = AsyncLLM(llama[1], dense=True, max_batch=1, max_consecutive_failures=2)
        raised = poison_backend(engine.engine, 99)

        def run(prompt):
            return tokens_or_error(engine, prompt)

        try:
            results = await asyncio.gather(run([5, 6, 7]), run([99, 1, 2]), run([8, 9, 10]))
            alive_after_one = engine.is_alive
            pages = await engine.run_on_engine(lambda e: (e.scheduler.check_integrity(), e.stats()["pages_in_use"]))
            poison_backend(engine.engine, 99, times=5)
            again = await asyncio.gather(run([99, 3]), run([99, 4]))
            for _ in range(100):
                if not engine.is_alive:
                    break
                await asyncio.sleep(0.01)
            return results, alive_after_one, pages[1], again, engine.is_alive, engine.error, len(raised)
        finally:
            engine.shutdown()

    from tinyserve_trt.runtime.engine import EngineBroken, StepFailed

    with caplog.at_level("ERROR", logger="tinyserve.engine"):
        results, alive_after_one, in_use, again, alive, error, n_raised = asyncio.run(main())
    assert results[0] == results[2] == GREEDY.max_tokens and n_raised == 1
    assert isinstance(results[1], StepFailed) and "injected" in str(results[1])
    assert alive_after_one and in_use == 0
    assert all(isinstance(r, RuntimeError) for r in again)  # two failures in a row: it gives up
    assert not alive and isinstance(error, EngineBroken) and "2 consecutive" in str(error)
    assert "injected backend failure" in caplog.text and "Traceback" in caplog.text  # logged with its traceback


def test_async_llm_fails_one_request_whose_delivery_raises(llama, monkeypatch):
    """Text/stop handling of one request raising (outside the engine step) fails that request
    only: its pages are freed and the others finish."""
    import tinyserve_trt.runtime.async_llm as async_llm
    from tinyserve_trt.runtime.engine import StepFailed

    class Flaky(async_llm.RequestTracker):
        def update(self, seq):
            if self.prompt_token_ids[0] == 99:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return super().update(seq)

    monkeypatch.setattr(async_llm, "RequestTracker", Flaky)

    async def main():
        engine = AsyncLLM(llama[1], dense=True)

        def run(prompt):
            return tokens_or_error(engine, prompt)

        try:
            got = await asyncio.gather(run([5, 6]), run([99, 1]), run([7, 8]))
            in_use = await engine.run_on_engine(lambda e: (e.scheduler.check_integrity(), e.stats()["pages_in_use"]))
            return got, in_use[1], engine.is_alive
        finally:
            engine.shutdown()

    got, in_use, alive = asyncio.run(main())
    assert got[0] == got[2] == GREEDY.max_tokens and isinstance(got[1], StepFailed) and "injected" in str(got[1])
    assert in_use == 0 and alive
