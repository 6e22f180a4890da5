"""The TensorRT engine's optimization profile covers every dynamic input of the package.

TensorRT refuses to build when a dynamic input has no range, and inputs that share an
ONNX dim name must get overlapping ranges (and equal values at run time). Checked on
the tiny LLaMA packages, with and without the INT8 cold tier, and two-level (its sparse
layers' ``key_sub_bounds``), against the ONNX inputs themselves - no TensorRT needed.
"""

from __future__ import annotations

import json

import onnx
import pytest

from tinyserve_trt.export.config import ExportConfig
from tinyserve_trt.contracts.engine_profiles import engine_profiles


@pytest.fixture(scope="module")
def llama_two_level(tmp_path_factory):
    """(source, two-level package, manifest): pages of 8, sub-pages of 4, layer 0 dense."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.tiny_models import build_package

    src, pkg = build_package("llama", tmp_path_factory.mktemp("two_level_trt"), page_size=8, sub_page_size=4)
    return src, pkg, json.loads((pkg / "tinyserve.json").read_text())


@pytest.fixture(scope="module")
def llama_int4_mixed(llama, tmp_path_factory):
    """(source, INT4 package whose layer 0 keeps INT8 cold pages, manifest): per-layer cold shapes."""
    from tinyserve_trt.export.pipeline import export_model

    src, _, manifest = llama
    pkg = tmp_path_factory.mktemp("int4_mixed_trt") / "pkg"
    export_model(src, pkg, ExportConfig(page_size=4, token_budget=16, dense_layers=1, cold_pages=True,
                                        cold_format="int4", int8_layers=(0,), validate=False), quiet=True)
    return src, pkg, json.loads((pkg / "tinyserve.json").read_text())


def _inputs(pkg):
    model = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    return {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}


@pytest.mark.parametrize("which", ["llama", "llama_cold", "llama_two_level", "llama_int4_mixed"])
def test_every_dynamic_input_has_a_consistent_range(request, which):
    _, pkg, manifest = request.getfixturevalue(which)
    profiles, limits = engine_profiles(manifest, manifest["max_context"])
    inputs = _inputs(pkg)
    dynamic = {name for name, dims in inputs.items() if any(isinstance(d, str) for d in dims)}
    assert dynamic <= set(profiles), f"no profile for {sorted(dynamic - set(profiles))}"
    assert set(profiles) <= set(inputs)
    ranges: dict[str, list[tuple[int, int]]] = {}
    for name, (lo, opt, hi) in profiles.items():
        dims = inputs[name]
        assert len(lo) == len(opt) == len(hi) == len(dims), name
        for axis, dim in enumerate(dims):
            assert 1 <= lo[axis] <= opt[axis] <= hi[axis], (name, axis)
            if isinstance(dim, int):
                assert lo[axis] == hi[axis] == dim, (name, axis)  # static dims are what the model says
            else:
                ranges.setdefault(dim, []).append((lo[axis], hi[axis]))
    for dim, spans in ranges.items():  # same-named dims: overlapping intervals
        assert max(lo for lo, _ in spans) <= min(hi for _, hi in spans), (dim, spans)
    page_pools = [profiles[layer["key_cache"]][2][0] for layer in manifest["io"]["layers"]]
    assert set(page_pools) == {limits["max_pool_pages"]}
    assert limits["max_pages"] == -(-manifest["max_context"] // manifest["page_size"])
    if which == "llama_int4_mixed":  # the INT8 layer's pools are [.., D], the INT4 layer's packed [.., D/2]
        d = manifest["head_dim"]
        assert [profiles[layer["key_cache_int8"]][2][-1] for layer in manifest["io"]["layers"]] == [d, d // 2]
    if which in ("llama_cold", "llama_int4_mixed"):
        layer = manifest["io"]["layers"][0]
        hot, cold, rows = (profiles[layer[r]][2][0] for r in ("key_cache", "key_cache_int8", "key_min"))
        assert rows == hot + cold and limits["max_cold_pages"] == cold  # metadata rows cover both tiers
    else:
        assert limits["max_cold_pages"] == 0
    subs = [layer.get("key_sub_bounds") for layer in manifest["io"]["layers"]]
    if which == "llama_two_level":
        assert subs[0] is None and all(subs[1:])  # the dense layer takes no codes
        for layer in manifest["io"]["layers"][1:]:
            lo, opt, hi = profiles[layer["key_sub_bounds"]]
            assert [s[0] for s in (lo, opt, hi)] == [s[0] for s in profiles[layer["key_min"]]]
            assert hi[2] == manifest["page_size"] // manifest["sub_page_size"] == 2
    else:
        assert not any(subs)


def test_a_cold_tier_can_be_exported_for_tensorrt():
    """The trt runtime backend binds INT8 pools now; the export no longer refuses."""
    assert ExportConfig(backend="trt", cold_pages=True).has_cold_tier
