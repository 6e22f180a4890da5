"""A policy added in one commit (issue #32): ``key_spread`` is a class in ops/policies.py, this test
and docs/op.md's regenerated table - no schema, header, C++ or CUDA edit.

Its reference == its ONNX function on random cases is ``tests/ops/test_function_vs_reference.py::
test_every_policy_matches_reference`` (parametrized over the registry). Here: the schema and the
generated header take it from the registry as they are, the native kernels refuse it, and a package
exported with ``--policy key_spread`` decodes on the op's function with the kernel report saying why.
"""

from __future__ import annotations

import json

import pytest

from tinyserve_trt.contracts.manifest import MANIFEST_FILE, MODEL_FILE
from tinyserve_trt.ops import policies, schema

POLICY = "key_spread"


def test_the_schema_takes_the_policy_from_the_registry_and_the_header_does_not_change():
    from tinyserve_dev import schema_header
    from tinyserve_trt.cpu import node
    from tinyserve_trt.cuda import library

    assert POLICY in schema.POLICIES and POLICY in schema.attribute("policy").choices
    assert POLICY not in schema.POLICY_IDS and POLICY not in schema.TWO_LEVEL_POLICIES
    assert POLICY not in schema_header.render()  # no C id: the committed header stays valid
    assert POLICY not in node.POLICIES and POLICY not in library.CUDA_POLICIES
    with pytest.raises(ValueError, match="no native id"):
        library.make_attrs(schema.OpAttributes(policy=POLICY))
    with pytest.raises(ValueError, match="does not implement policy"):
        node.make_decode_node([""] * 10, ["o"], schema.OpAttributes(policy=POLICY))


def test_a_package_with_the_policy_decodes_on_the_function_and_says_why(export_fixture, tmp_path):
    from tinyserve_trt import LLM, SamplingParams
    from tinyserve_trt.export.config import ExportConfig
    from tinyserve_trt.export.pipeline import export_model

    src = export_fixture("llama", "legacy_eager") / MODEL_FILE
    pkg = tmp_path / "pkg"
    export_model(src, pkg, ExportConfig(page_size=8, policy=POLICY, dense_layers=0), quiet=True)
    manifest = json.loads((pkg / MANIFEST_FILE).read_text())
    assert manifest["policy"] == POLICY and POLICY in {layer["policy"] for layer in manifest["io"]["layers"]}
    llm = LLM(pkg, max_batch=1, token_budget=16)
    report = llm.engine.kernel_report
    assert report.decode_kernel == "onnx_function" and POLICY in report.reason
    out = llm.generate(prompt_token_ids=[list(range(3, 40))],
                       params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("policy", [p for p in schema.POLICIES if p not in policies.implemented_by("cuda")])
def test_the_tensorrt_backend_refuses_a_policy_without_a_cuda_kernel_at_export(policy, tmp_path, capsys):
    """A TensorRT package runs the op only as the plugin's CUDA kernels: a policy they lack is
    refused by the config (one line, exit 2) before any work, not by a failing engine build."""
    from tinyserve_trt.export.cli import main
    from tinyserve_trt.export.config import ExportConfig

    with pytest.raises(ValueError, match=f"policy {policy!r} has no CUDA kernel"):
        ExportConfig(policy=policy, backend="trt")
    ExportConfig(policy=policy, backend="ort")  # the ORT backend runs it as the op's function
    src = tmp_path / "model.onnx"
    src.write_bytes(b"")
    code = main([str(src), "-o", str(tmp_path / "pkg"), "--backend", "trt", "--policy", policy])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and f"policy {policy!r} has no CUDA kernel" in err, err
    assert not (tmp_path / "pkg").exists()
