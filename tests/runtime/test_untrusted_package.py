"""A package is untrusted input (issue #29): what the runtime writes beside it, the caches it
hands to ONNX Runtime, and the one-line PackageErrors for bad package content."""

from __future__ import annotations

import os

import pytest

onnx = pytest.importorskip("onnx")

from tinyserve_trt.runtime.backends import ort_providers  # noqa: E402


def _model_with_function(path):
    """A model whose one node is a model-local function (as the exporter's op is)."""
    from onnx import TensorProto, helper

    fn = helper.make_function("tinyserve", "Twice", ["x"], ["y"], [helper.make_node("Add", ["x", "x"], ["y"])],
                              [helper.make_opsetid("", 17)])
    graph = helper.make_graph([helper.make_node("Twice", ["a"], ["b"], domain="tinyserve")], "g",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, functions=[fn], opset_imports=[helper.make_opsetid("", 17),
                                                                    helper.make_opsetid("tinyserve", 1)])
    onnx.save(model, str(path))


@pytest.fixture
def outside(tmp_path):
    """A file outside the package (a stand-in for ~/.bashrc) and the package directory."""
    victim = tmp_path / "bashrc"
    victim.write_bytes(b"export PS1='$ '\n")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    _model_with_function(pkg / "model.onnx")
    return victim, pkg


# ---- finding 1: the inlined model is written to a fresh temp file, never through a shipped link ----
@pytest.mark.parametrize("name", ["model.inlined.tmp", "model.inlined.onnx"])
def test_inlining_never_writes_through_a_symlink_the_package_ships(outside, name):
    victim, pkg = outside
    before = victim.read_bytes()
    (pkg / name).symlink_to(victim)
    os.utime(victim)  # newer than model.onnx: a naive cache check would take it
    model = ort_providers.inlined_model(pkg / "model.onnx")
    assert victim.read_bytes() == before
    assert isinstance(model, (bytes, os.PathLike, str))
    if not isinstance(model, bytes):
        model = os.fspath(model)
        assert os.path.realpath(model).startswith(os.path.realpath(pkg) + os.sep)
        assert not os.path.islink(model)
        inlined = onnx.load(model)
        assert not inlined.functions and [n.op_type for n in inlined.graph.node] == ["Add"]
    assert not [p for p in pkg.iterdir() if p.name.startswith(".") or p.suffix == ".tmp" and not p.is_symlink()]
