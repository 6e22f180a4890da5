"""The kernel report (issue #32): an engine says which graph and decode kernel it runs, and why.

With no C++ compiler and an empty build cache the native CPU kernel cannot be built: the engine
then decodes on the op's ONNX function - and says so (log line, ``stats()``, ``/metrics``) - or,
with ``require_native`` / ``--require-native``, refuses to start with one line (exit 2).
"""

from __future__ import annotations

import json
import logging

import onnx
import pytest

from tinyserve_trt.cpu import native
from tinyserve_trt.runtime.backends.kernel_report import (DECODE_KERNELS, REPORT_KEYS, KernelReport,
                                                          NativeRequired, export_note)
from tinyserve_trt.runtime.cli import main
from tinyserve_trt.runtime.sampling import SamplingParams
from tinyserve_trt.runtime.server.metrics import ServerMetrics, parse_metrics

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """No C++ compiler, an empty private build cache, no prebuilt library, and this process's build forgotten."""
    monkeypatch.setattr(native, "_BUILT", {})
    monkeypatch.setattr(native, "PREBUILT_DIR", tmp_path / "no-prebuilt")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(native.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.delenv(native.ENV_DISABLE, raising=False)
    reason = native.available() or ""
    assert "no C++ compiler" in reason and "no prebuilt library" in reason
    return tmp_path


def _ort_graph_is_native(manifest) -> bool:
    import onnxruntime as ort

    from tinyserve_trt.contracts.manifest import Manifest

    opt = Manifest.from_dict(manifest).ort_optimized
    return opt is not None and opt.onnxruntime == ort.__version__ and bool(opt.native)


# ---- the record ------------------------------------------------------------------
def test_a_report_is_checked_and_reads_as_one_line():
    with pytest.raises(ValueError, match="decode_kernel"):
        KernelReport("ort", "cpu", "model.onnx", "fast")
    with pytest.raises(ValueError, match="fallback needs a reason"):
        KernelReport("ort", "cpu", "model.onnx", "onnx_function", fallback=True)
    report = KernelReport("ort", "cpu", "model.onnx", "onnx_function", cold_format="int8", fallback=True,
                          reason="no C++ compiler:\n'c++' is not on PATH")
    line = report.line()
    assert "\n" not in line and "model.onnx" in line and DECODE_KERNELS["onnx_function"] in line
    assert "int8" in line and "fallback: no C++ compiler: 'c++' is not on PATH" in line
    assert set(report.stats()) == set(REPORT_KEYS) and report.stats()["kernel_fallback"] is True
    with pytest.raises(NativeRequired) as err:
        report.check_native()
    assert "no C++ compiler" in str(err.value) and "\n" not in str(err.value)
    KernelReport("trt", "tensorrt", "model.plan", "tensorrt_plugin").check_native()  # native: no error


def test_the_export_note_says_why_the_package_decodes_on_the_function():
    from types import SimpleNamespace as NS

    assert export_note(NS(ort_optimized=None, validation=None)).startswith("the package has no ONNX Runtime graph")
    assert export_note(NS(ort_optimized=NS(native="tinyserve.cpu", native_note=None), validation={})) is None
    opted_out = NS(native=None, native_note="package exported with --no-native-decode")
    assert export_note(NS(ort_optimized=opted_out, validation={})) == "package exported with --no-native-decode"
    older = NS(ort_optimized=NS(native=None), validation={"ort_native_check": "skipped: no compiler"})
    assert "skipped: no compiler" in export_note(older)  # a package from before the note


# ---- the engine ------------------------------------------------------------------
def test_the_engine_reports_its_kernel_in_stats_and_the_log(llama, caplog):
    from tinyserve_trt.runtime.llm import LLM

    _, pkg, manifest = llama
    with caplog.at_level(logging.INFO, logger="tinyserve.runtime"):
        llm = LLM(pkg, max_batch=2)
    stats = llm.stats()
    assert set(REPORT_KEYS) <= set(stats) and stats["kernel_provider"] == "cpu"
    assert stats["kernel_cold_format"] is None  # a hot-only package
    lines = [r.getMessage() for r in caplog.records if "kernel report" in r.getMessage()]
    assert len(lines) == 1 and llm.engine.kernel_report.line() in lines[0]  # once, at start
    if _ort_graph_is_native(manifest) and native.available() is None:
        assert stats["kernel_decode"] == "native_cpu" and stats["kernel_graph"] == manifest["ort_optimized"]["file"]
        assert stats["kernel_fallback"] is False and stats["kernel_reason"] is None
        assert stats["kernel_library"].endswith(native.LIBRARY_NAME)
        assert caplog.records[-1].levelno == logging.INFO
        # the line names the native node types the loaded graph runs (a version-3 graph: the layer node)
        graph = onnx.load(str(pkg / manifest["ort_optimized"]["file"]), load_external_data=False)
        types = {n.op_type for n in graph.graph.node if n.domain == native.DOMAIN}
        assert types and all(t in lines[0] for t in types), (types, lines[0])
    llm.close()


def test_a_cold_tier_package_reports_its_cold_format(llama_cold):
    from tinyserve_trt.runtime.llm import LLM

    _, pkg, _ = llama_cold
    assert LLM(pkg, max_batch=2).stats()["kernel_cold_format"] == "int8"
    assert LLM(pkg, max_batch=2, kv_tiers=False).stats()["kernel_cold_format"] is None  # every page hot


def test_without_a_compiler_the_engine_falls_back_and_says_why(llama, no_compiler, caplog):
    from tinyserve_trt.runtime.llm import LLM

    _, pkg, manifest = llama
    if not _ort_graph_is_native(manifest):
        pytest.skip("the tiny package's optimized graph does not call the native op here")
    with caplog.at_level(logging.WARNING, logger="tinyserve.runtime"):
        llm = LLM(pkg, max_batch=2)
    report = llm.engine.kernel_report
    assert (report.decode_kernel, report.graph, report.fallback) == ("onnx_function", "model.onnx", True)
    assert "no C++ compiler" in report.reason and "loading the portable model" in report.reason
    assert [r.levelno for r in caplog.records if "kernel report" in r.getMessage()] == [logging.WARNING]
    assert len(llm.generate(params=GREEDY, prompt_token_ids=[[1, 2, 3]])[0].outputs[0].token_ids) == 3
    with pytest.raises(NativeRequired, match="no C\\+\\+ compiler"):
        LLM(pkg, max_batch=2, require_native=True)


# ---- the command line --------------------------------------------------------------
def test_generate_require_native_exits_2_with_one_line_without_a_compiler(llama, no_compiler, capsys):
    _, pkg, manifest = llama
    if not _ort_graph_is_native(manifest):
        pytest.skip("the tiny package's optimized graph does not call the native op here")
    common = ["generate", str(pkg), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--ignore-eos"]
    assert main([*common, "--require-native"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no C++ compiler" in err and "require" in err and "Traceback" not in err
    # without the flag it runs, and the report says why it fell back: in the JSON and on stderr
    assert main([*common, "--json"]) == 0
    captured = capsys.readouterr()
    engine = json.loads(captured.out)["stats"]["engine"]
    assert engine["kernel_decode"] == "onnx_function" and engine["kernel_fallback"] is True
    assert "no C++ compiler" in engine["kernel_reason"]
    assert captured.err.count("kernel report") == 1 and "no C++ compiler" in captured.err  # the warning, once


def test_generate_ends_its_text_output_with_the_report(llama, capsys):
    assert main(["generate", str(llama[1]), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    assert "kernel report: graph " in err.splitlines()[-1] and err.count("kernel report") == 1


def test_generate_text_says_a_fallback_once(llama, no_compiler, capsys):
    _, pkg, manifest = llama
    if not _ort_graph_is_native(manifest):
        pytest.skip("the tiny package's optimized graph does not call the native op here")
    assert main(["generate", str(pkg), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    assert err.count("kernel report") == 1 and "fallback: " in err


def test_serve_require_native_exits_2_with_one_line_without_a_compiler(llama, no_compiler, capsys):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    _, pkg, manifest = llama
    if not _ort_graph_is_native(manifest):
        pytest.skip("the tiny package's optimized graph does not call the native op here")
    assert main(["serve", str(pkg), "--port", "0", "--require-native"]) == 2  # before uvicorn starts
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no C++ compiler" in err


# ---- /metrics ------------------------------------------------------------------------
def test_metrics_carry_the_report_as_an_info_gauge():
    report = KernelReport("ort", "cpu", "model.onnx", "onnx_function", fallback=True, reason='no "c++"')
    engine = dict(pages_free=1, pages_in_use=0, pages_cached_idle=0, pages_total=1, prefix_hit_rate=0.0,
                  page_selection_rate=None, token_budget=0, preemptions=0, **report.stats())
    got = parse_metrics(ServerMetrics().render(engine, 0, 0, 0))
    info = [k for k in got if k.startswith("tinyserve_kernel_info{")]
    assert len(info) == 1 and got[info[0]] == 1
    assert 'decode="onnx_function"' in info[0] and 'graph="model.onnx"' in info[0] and 'no \\"c++\\"' in info[0]
    assert got["tinyserve_kernel_fallback"] == 1
    del engine["kernel_decode"]  # an engine without a report: no kernel series
    assert not any(k.startswith("tinyserve_kernel") for k in parse_metrics(ServerMetrics().render(engine, 0, 0, 0)))


def test_a_package_with_an_older_native_node_decodes_on_the_function_and_says_re_export(llama, tmp_path):
    """A package exported before the node's inputs moved (tinyserve.cpu version 1: key_sub_bounds at
    10) must not reach this runtime's kernel (versions 2-3), which reads inputs at the schema's positions:
    before, its first decode step failed ("cold pages need all of key_cache_int8, ..."). It now loads
    the portable model, says why, and decodes the same ids."""
    import shutil

    import onnx

    from tinyserve_trt.cpu import node
    from tinyserve_trt.runtime.llm import LLM

    src, pkg, manifest = llama
    if not _ort_graph_is_native(manifest):
        pytest.skip("the fixture package's ORT graph does not call the native node")
    old = tmp_path / "old-pkg"
    shutil.copytree(pkg, old)
    graph = old / manifest["ort_optimized"]["file"]
    model = onnx.load(str(graph), load_external_data=False)
    for op in model.opset_import:
        if op.domain == node.DOMAIN:
            op.version = min(node.RUNS_VERSIONS) - 1  # version 1: its own input positions
    onnx.save(model, str(graph))
    want = LLM(pkg, max_batch=1).generate(prompt_token_ids=[[5, 6, 7, 8, 9]], params=GREEDY)[0].outputs[0].token_ids
    llm = LLM(old, max_batch=1)
    stats = llm.stats()
    assert stats["kernel_decode"] == "onnx_function" and stats["kernel_fallback"] is True
    assert "re-export" in stats["kernel_reason"] and f"version {min(node.RUNS_VERSIONS) - 1}," in stats["kernel_reason"]
    got = llm.generate(prompt_token_ids=[[5, 6, 7, 8, 9]], params=GREEDY)[0].outputs[0].token_ids
    assert got == want
    with pytest.raises(NativeRequired, match="re-export"):
        LLM(old, max_batch=1, require_native=True)


def test_a_plan_recording_an_older_native_node_loads_the_portable_model(llama, tmp_path):
    """The manifest's typed plan records the native node's version (``ort_optimized.plan.native_version``);
    one this runtime does not run is refused as the graph's own opset import is."""
    import shutil

    from tinyserve_trt.contracts.manifest import MANIFEST_FILE
    from tinyserve_trt.cpu import node
    from tinyserve_trt.runtime.llm import LLM

    _, pkg, manifest = llama
    if not _ort_graph_is_native(manifest):
        pytest.skip("the fixture package's ORT graph does not call the native node")
    assert manifest["ort_optimized"]["plan"]["native_version"] == node.VERSION
    old = tmp_path / "old-plan"
    shutil.copytree(pkg, old)
    data = json.loads((old / MANIFEST_FILE).read_text())
    older = min(node.RUNS_VERSIONS) - 1
    data["ort_optimized"]["plan"]["native_version"] = older
    (old / MANIFEST_FILE).write_text(json.dumps(data))
    stats = LLM(old, max_batch=1).stats()
    assert stats["kernel_decode"] == "onnx_function" and f"version {older}" in stats["kernel_reason"]
    # version 2 (decode only, its graphs switch on If(S == 1)) reads the same positions: it runs
    data["ort_optimized"]["plan"]["native_version"] = 2
    (old / MANIFEST_FILE).write_text(json.dumps(data))
    assert 2 in node.RUNS_VERSIONS and LLM(old, max_batch=1).stats()["kernel_decode"] == "native_cpu"
