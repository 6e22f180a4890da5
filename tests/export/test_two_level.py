"""tinyserve-export --sub-page-size: two-level sparse layers (issue #15).

Structure (sparse layers take ``key_sub_bounds`` after four skipped cold inputs, dense layers
stay single-level), validation against the original passes, and a sparse-budget run of the
exported model reads the fine bounds the validator maintains. Serving such a package needs the
runtime pools to feed ``key_sub_bounds`` (not yet: see docs/op.md).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from tinyserve_trt.export import cli
from tinyserve_trt.export.config import ExportConfig
from tinyserve_trt.ops import schema
from tinyserve_trt.ops.node import node_attributes
from tinyserve_trt.contracts.manifest import MANIFEST_FILE as MANIFEST


@pytest.fixture(scope="module")
def two_level_pkg(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.tiny_models import build_package

    src, pkg = build_package("llama", tmp_path_factory.mktemp("two_level"), page_size=8, sub_page_size=4,
                             candidate_share=0.5)
    return src, pkg, json.loads((pkg / MANIFEST).read_text())


def test_sparse_layers_take_the_fine_bounds(two_level_pkg):
    _, pkg, manifest = two_level_pkg
    model = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    ops = [n for n in model.graph.node if n.op_type == schema.OP_TYPE]
    inputs = {i.name: i for i in model.graph.input}
    hkv, d = manifest["num_kv_heads"], manifest["head_dim"]
    for i, (node, layer) in enumerate(zip(ops, manifest["io"]["layers"])):
        attrs = node_attributes(node)
        if i < manifest["dense_layers"]:
            assert attrs.sub_page_size == 0 and len(node.input) == schema.NUM_REQUIRED_INPUTS
            assert "key_sub_bounds" not in layer
            continue
        assert (attrs.sub_page_size, attrs.candidate_share) == (4, 0.5)
        assert node.overload == f"query_aware_{manifest['group_reduce']}_two_level".replace("_max", "")
        assert list(node.input[schema.NUM_REQUIRED_INPUTS:]) == ["", "", "", "", f"key_sub_bounds.{i}"]
        assert layer["key_sub_bounds"] == f"key_sub_bounds.{i}"
        t = inputs[layer["key_sub_bounds"]].type.tensor_type
        assert t.elem_type == onnx.TensorProto.UINT8
        assert [x.dim_param or x.dim_value for x in t.shape.dim] == ["num_pages", hkv, 2, d]
    assert manifest["validation"]["max_abs_logit_diff"] <= manifest["validation"]["tolerance"]


def test_sparse_budget_reads_the_fine_bounds(two_level_pkg, monkeypatch):
    """The validator's paged state feeds key_sub_bounds. At budget 24 (6 sub-pages; about half of
    ~8 pages are candidates) the two-level layers select: logits move away from the original's,
    stay finite, and change again when every fine bound is replaced by its page's (code 0)."""
    import onnxruntime as ort

    from tinyserve_trt.export import validate as validate_mod

    src, pkg, manifest = two_level_pkg
    original = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    rewritten = ort.InferenceSession(str(pkg / "model.onnx"), providers=["CPUExecutionProvider"])
    run = dict(lengths=(60, 45), decode_steps=6)
    dense = validate_mod.validate(original, rewritten, manifest, budget=0, **run)
    sparse_logits = _Recorded(rewritten)
    sparse = validate_mod.validate(original, sparse_logits, manifest, budget=24, **run)
    assert dense.max_abs_diff <= manifest["validation"]["tolerance"]
    assert np.isfinite(sparse.max_abs_diff) and sparse.max_abs_diff > 10 * dense.max_abs_diff
    monkeypatch.setattr(validate_mod, "page_sub_bounds", lambda keys, sp, *a: np.zeros(
        (keys.shape[0], keys.shape[1] // sp, keys.shape[2]), np.uint8))
    coarse_logits = _Recorded(rewritten)
    validate_mod.validate(original, coarse_logits, manifest, budget=24, **run)
    # the worst step vs the original may not be one the fine bounds decide: compare the logits
    assert max(np.abs(a - b).max() for a, b in zip(sparse_logits.logits, coarse_logits.logits)) > 1e-3


class _Recorded:
    """A session that keeps the first output (the logits) of every run."""

    def __init__(self, session):
        self.session, self.logits = session, []

    def __getattr__(self, name):
        return getattr(self.session, name)

    def run(self, names, feeds):
        out = self.session.run(names, feeds)
        self.logits.append(np.array(out[0]))
        return out


def test_config_and_cli_refuse_bad_sub_pages(capsys):
    with pytest.raises(ValueError, match="divide the page size"):
        ExportConfig(page_size=8, sub_page_size=3)
    with pytest.raises(ValueError, match="sub_page_size"):
        ExportConfig(policy="window", sub_page_size=4)
    assert ExportConfig(page_size=16, sub_page_size=16).layer_attributes(5, 0.1).sub_page_size == 0  # single-level
    assert ExportConfig(sub_page_size=4).layer_attributes(0, 0.1).sub_page_size == 0  # a dense layer
    code = cli.main(["model.onnx", "-o", "x", "--sub-page-size", "5"])
    err = capsys.readouterr().err
    assert code == 2 and "sub_page_size" in err and "Traceback" not in err


def test_two_level_is_the_default_where_the_op_supports_it():
    """The measured default (config.DEFAULT_PAGE_SIZE -> DEFAULT_SUB_PAGE_SIZE, issue #15) for ORT
    and TensorRT packages of query_aware; other policies stay single level; `auto` picks it."""
    from tinyserve_trt.export import config as export_config

    d = ExportConfig()
    ps, sp = export_config.DEFAULT_PAGE_SIZE, export_config.DEFAULT_SUB_PAGE_SIZE
    assert (d.resolved_page_size(), d.resolved_sub_page_size()) == (ps, sp)
    assert d.layer_attributes(5, 0.1).sub_page_size == sp
    assert d.layer_attributes(5, 0.1).candidate_share == export_config.DEFAULT_CANDIDATE_SHARE
    assert ExportConfig(page_size="auto", max_context=65536).resolved_page_size() == ps
    assert ExportConfig(page_size="auto", max_context=65536, sub_page_size=0).resolved_page_size() == 64
    assert ExportConfig(policy="window").resolved_sub_page_size() == 0
    assert ExportConfig(backend="trt").resolved_sub_page_size() == sp
    assert ExportConfig(backend="trt").layer_attributes(5, 0.1).sub_page_size == sp
    assert ExportConfig(page_size=sp).resolved_sub_page_size() == 0  # pages no larger than a sub-page
    args = cli.parser().parse_args(["m.onnx"])
    assert cli._config(args).resolved_sub_page_size() == sp
