"""model.ort.onnx runs the op on the native CPU kernel: each op node it implements becomes one
native node, for decode steps and prefill chunks (node version 3; no ``If``, no inlined function).

The structure, which nodes it leaves alone (policies the kernel lacks), the manifest
record, and that the native graph gives the function graph's logits with
selection on and the original export's greedy ids dense.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from tinyserve_trt.contracts.manifest import MANIFEST_FILE, MODEL_FILE, ORT_GRAPH_FILE
from tinyserve_trt.cpu import native as cpu_native
from tinyserve_trt.export.config import ExportConfig
from tinyserve_trt.export.native_decode import (NATIVE_DOMAIN, NATIVE_OP, decode_summary, ineligible, native_calls,
                                                unsupported, uses_native)
from tinyserve_trt.export.ort_graph import prepared_graph
from tinyserve_trt.export.pipeline import export_model
from tinyserve_trt.ops import schema
from tinyserve_trt.ops.node import make_node

CONFIG = ExportConfig(page_size=8, sub_page_size=4, dense_layers=1)  # a dense layer and a two-level one
needs_native = pytest.mark.skipif(cpu_native.available() is not None,
                                  reason=f"native CPU kernel unavailable: {cpu_native.available()}")


def _export(export_fixture, tmp_path, name="pkg", config=CONFIG, kind="llama"):
    src = export_fixture(kind, "legacy_eager") / MODEL_FILE
    export_model(src, tmp_path / name, config, quiet=True)
    return tmp_path / name, json.loads((tmp_path / name / MANIFEST_FILE).read_text())


def _natives(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The native nodes: the op's, or the layer's around it (native_layer.py, test_native_layer.py)."""
    return [n for n in graph.node if n.domain == NATIVE_DOMAIN and n.op_type in (NATIVE_OP, cpu_native.LAYER_OP_TYPE)]


def test_every_layer_runs_on_the_kernel_without_a_switch(export_fixture, tmp_path):
    pkg, manifest = _export(export_fixture, tmp_path, config=ExportConfig(page_size=8, sub_page_size=4,
                                                                          dense_layers=1, validate=False))
    proto = onnx.load(str(pkg / MODEL_FILE), load_external_data=False)
    plain, native = prepared_graph(proto), prepared_graph(proto, native=True)
    assert not _natives(plain.graph) and not uses_native(plain)
    natives = _natives(native.graph)
    assert len(natives) == manifest["num_layers"] and uses_native(native)
    # no If, no inlined op body, none of the per-step values only the body read
    assert not [n for n in native.graph.node if n.op_type == "If"]
    assert not [n for n in native.graph.node if n.op_type == "TopK"]
    assert len(native.graph.node) < len(plain.graph.node) - 40 * manifest["num_layers"]
    # each native node reads its layer's pools and writes the selected pages the op node wrote
    ops = [n for n in proto.graph.node if n.domain == schema.DOMAIN]
    assert [n.output[1] for n in natives] == [o.output[1] for o in ops]
    pools = schema.INPUT_NAMES.index("key_cache")
    assert [n.input[-len(o.input) + pools:] for n, o in zip(natives, ops)] == [o.input[pools:] for o in ops]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in natives]
    assert [a["policy"] for a in attrs] == [b"dense", b"query_aware"]
    assert attrs[1]["sub_page_size"] == 4 and "cold_format" not in attrs[1]
    assert {i.domain: i.version for i in native.opset_import}[NATIVE_DOMAIN] == 3
    # the portable model (what TensorRT parses) is untouched
    assert not uses_native(proto) and not _natives(proto.graph)


def _node(policy="query_aware", cold=False):
    names = list(schema.node_input_names(cold_pages=cold))
    return make_node(names, ["out"], schema.OpAttributes(policy=policy), cold_pages=cold)


def test_nodes_the_kernel_does_not_implement_keep_the_function():
    f32 = {"key_cache": onnx.TensorProto.FLOAT}
    assert ineligible(_node(), f32) is None and ineligible(_node("dense"), f32) is None
    assert "policy 'window'" in ineligible(_node("window"), f32)
    assert ineligible(_node(cold=True), f32) is None  # INT8 / INT4 cold pages: the kernel reads them
    assert "element type" in ineligible(_node(), {"key_cache": onnx.TensorProto.FLOAT16})
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [_node("window")], "g", [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                                 for n in schema.node_input_names()], []))
    assert native_calls(model) == [] and not uses_native(model)
    assert "policy 'window'" in unsupported(model)  # the export's record says why, and skips the check


def test_unsupported_names_why_no_layer_is_native():
    def model(*nodes, elem=onnx.TensorProto.FLOAT):
        inputs = {n for node in nodes for n in node.input if n}
        return onnx.helper.make_model(onnx.helper.make_graph(
            list(nodes), "g", [onnx.helper.make_tensor_value_info(n, elem, None) for n in sorted(inputs)], []))

    assert unsupported(model(_node(cold=True))) is None
    partial = _node(cold=True)
    partial.input[schema.INPUT_NAMES.index("key_scale")] = ""
    assert unsupported(model(partial)) == "some cold-page inputs missing"
    assert "element type" in unsupported(model(_node(), elem=onnx.TensorProto.FLOAT16))
    assert unsupported(model(_node())) is None
    assert unsupported(model()) == f"no {schema.OP_TYPE} node"


def test_the_summary_names_what_decodes_and_why_the_function():
    from tinyserve_trt.contracts.manifest import OrtOptimized
    from tinyserve_trt.contracts.ort_plan import OrtGraphPlan

    def record(**plan):
        return OrtOptimized(ORT_GRAPH_FILE, "1.0", plan=OrtGraphPlan(21, **plan))

    assert decode_summary(None) is None  # no ORT graph (a trt package)
    assert decode_summary(record(native_domain=NATIVE_DOMAIN, native_version=3)) == \
        f"native CPU kernel ({NATIVE_DOMAIN}), decode steps and prefill chunks"
    assert decode_summary(record(native_domain=NATIVE_DOMAIN, native_version=2)) == \
        f"native CPU kernel ({NATIVE_DOMAIN}); prefill: the op's ONNX function"
    assert decode_summary(record(native_why="package exported with --no-native-decode")) == \
        "the op's ONNX function (package exported with --no-native-decode)"
    assert decode_summary(record()) == "the op's ONNX function"


@needs_native
def test_export_records_the_kernel_and_its_graph_equals_the_function_graph(export_fixture, tmp_path):
    from tinyserve_trt.export.native_decode import session_options
    from tinyserve_trt.export.validate import paged_logits, sparse_lengths

    pkg, manifest = _export(export_fixture, tmp_path)
    plan = manifest["ort_optimized"]["plan"]
    assert (plan["native_domain"], plan["native_version"], plan["native_why"]) == (NATIVE_DOMAIN, 3, None)
    assert "ort_native" not in manifest["validation"]  # the choice is the typed plan; validation holds figures
    assert manifest["validation"]["ort_native_check"].startswith("dense max |logit diff| ")
    assert _natives(onnx.load(str(pkg / ORT_GRAPH_FILE), load_external_data=False).graph)
    import onnxruntime as ort

    proto = onnx.load(str(pkg / MODEL_FILE))
    ps = manifest["page_size"]
    got = {}
    for native in (False, True):
        graph = prepared_graph(proto, opset=manifest["ort_optimized"]["plan"]["opset"], native=native)
        sess = ort.InferenceSession(graph.SerializeToString(), session_options(graph),
                                    providers=["CPUExecutionProvider"])
        got[native] = {b: paged_logits(sess, manifest, b, sparse_lengths(ps)) for b in (0, 3 * ps)}
    for budget in (0, 3 * ps):
        worst = max(float(np.abs(a - b).max()) for a, b in zip(got[False][budget], got[True][budget]))
        assert worst <= CONFIG.tolerance(), budget
    # the budget selected: the sparse comparison ran the kernel's selection, not a dense step
    assert max(float(np.abs(a - b).max()) for a, b in zip(got[True][0][2:], got[True][3 * ps][2:])) > 1e-3


@needs_native
def test_opting_out_and_a_missing_kernel_keep_the_function(export_fixture, tmp_path, monkeypatch):
    pkg, manifest = _export(export_fixture, tmp_path, "off", ExportConfig(page_size=8, sub_page_size=4,
                                                                          dense_layers=1, native_decode=False))
    plan = manifest["ort_optimized"]["plan"]
    assert plan["native_domain"] is None and "ort_native_check" not in manifest["validation"]
    # the export's reason is recorded, and the runtime's kernel report (issue #32) says it
    assert plan["native_why"] == "package exported with --no-native-decode"
    from tinyserve_trt import LLM

    report = LLM(pkg, max_batch=1).engine.kernel_report
    assert (report.decode_kernel, report.fallback) == ("onnx_function", False)
    assert report.reason == "package exported with --no-native-decode"
    monkeypatch.setenv("TINYSERVE_NATIVE", "0")
    pkg, manifest = _export(export_fixture, tmp_path, "missing")
    assert manifest["ort_optimized"]["plan"]["native_domain"] is None
    assert manifest["validation"]["ort_native_check"].startswith("skipped: ")
    assert "TINYSERVE_NATIVE=0" in manifest["ort_optimized"]["plan"]["native_why"]


@needs_native
def test_runtime_without_the_kernel_loads_the_portable_model_and_decodes_the_same(export_fixture, tmp_path,
                                                                                  monkeypatch, caplog):
    from tinyserve_trt import LLM, SamplingParams

    pkg, _ = _export(export_fixture, tmp_path)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[(i * 37 + 11) % 256 for i in range(45)], list(range(5, 9))]
    with_kernel = [o.outputs[0].token_ids for o in LLM(pkg, token_budget=16).generate(
        prompt_token_ids=prompts, params=greedy)]
    monkeypatch.setenv("TINYSERVE_NATIVE", "0")
    with caplog.at_level("WARNING", logger="tinyserve.runtime"):
        llm = LLM(pkg, token_budget=16)
    assert "native CPU decode kernel is unavailable" in caplog.text
    assert [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, params=greedy)] == with_kernel


@needs_native
@pytest.mark.parametrize("cold_format", ["int8", "int4"])
def test_cold_page_packages_decode_on_the_kernel_as_on_the_function(export_fixture, tmp_path, monkeypatch,
                                                                    cold_format):
    """A package with a cold tier (INT8, or INT4 with keys on the sub-page bounds) runs every layer on
    the kernel too, and with pages really demoted the runtime's greedy ids on the kernel equal those on the
    function (model.onnx, TINYSERVE_NATIVE=0)."""
    from tinyserve_trt import LLM, SamplingParams

    config = ExportConfig(page_size=8, sub_page_size=4, dense_layers=1, cold_pages=True, cold_format=cold_format,
                          int8_layers="none" if cold_format == "int4" else None)
    pkg, manifest = _export(export_fixture, tmp_path, f"cold-{cold_format}", config)
    assert manifest["ort_optimized"]["plan"]["native_domain"] == NATIVE_DOMAIN
    graph = onnx.load(str(pkg / ORT_GRAPH_FILE), load_external_data=False).graph
    natives = _natives(graph)
    assert len(natives) == manifest["num_layers"]
    # the pools, page table, lengths, budget, the cold tier, and key_sub_bounds of the two-level layer
    first = {NATIVE_OP: 3, cpu_native.LAYER_OP_TYPE: 6}  # the layer node's prefix: rows and rotary tables
    pools = [[i for i in n.input[first[n.op_type]:] if i] for n in natives]
    assert [len(p) for p in pools] == [7 + 4, 7 + 4 + 1]

    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[(i * 37 + 11) % 256 for i in range(70)], [(i * 13 + 5) % 256 for i in range(41)]]

    def run():
        llm = LLM(pkg, token_budget=16, hot_fraction=0.25, prefix_sharing=False)
        out = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, params=greedy)]
        return out, llm.stats()["pages_demoted"]

    (on_kernel, demoted), (on_function, _) = run(), (monkeypatch.setenv("TINYSERVE_NATIVE", "0"), run())[1]
    assert demoted > 0 and on_kernel == on_function
