"""The typed manifest: round trip through tinyserve.json, and one-line PackageErrors naming the field."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tinyserve_trt.contracts.manifest import (FORMAT, FORMAT_VERSION, MANIFEST_FILE, ColdTier, Manifest,
                                              OrtOptimized, PackageError, PackageIO)
from tinyserve_trt.contracts.ort_plan import OrtGraphPlan
from tinyserve_trt.ops.cold_codec import INT4_FORMAT_VERSION

LAYER = {r: f"{r}.0" for r in ("key_cache", "value_cache", "key_min", "key_max", "new_key", "new_value")}
COLD = {r: f"{r}.0" for r in ("key_cache_int8", "value_cache_int8", "key_scale", "value_scale")}


def manifest(**kw) -> Manifest:
    io = PackageIO({r: r for r in ("input_ids", "page_table", "past_lens", "token_budget")}, {"logits": "logits"},
                   [dict(LAYER)])
    base = dict(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=32, page_size=4,
                token_budget=16, io=io, extra={"model_name": "tiny"})
    base.update(kw)
    return Manifest(**base)


def package(tmp_path, data: dict):
    (tmp_path / "model.onnx").write_bytes(b"")
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(data))
    return tmp_path


def test_round_trip_keeps_every_field_and_unknown_keys(tmp_path):
    cold = ColdTier(k_granularity="channel", v_granularity="token", hot_fraction=0.5, sink_pages=1,
                    recent_pages=2, decay=0.9, calibration={"file": "calibration.json"})
    io = PackageIO(manifest().io.inputs, {"logits": "logits"}, [{**LAYER, **COLD}])
    plan = OrtGraphPlan(17, False, "tinyserve.cpu", 2, opset_why="kept at opset 17: why", fusions_why="rounding")
    m = manifest(io=io, cold_tier=cold, ort_optimized=OrtOptimized(file="model.ort.onnx", onnxruntime="1.0", plan=plan),
                 engine={"file": "model.plan", "max_batch": 8}, eos_token_id=[2, 3])
    (tmp_path / "model.onnx").write_bytes(b"")
    m.save(tmp_path)
    data = json.loads((tmp_path / MANIFEST_FILE).read_text())
    assert data["format"] == FORMAT and data["format_version"] == FORMAT_VERSION and data["model_name"] == "tiny"
    assert "validation" not in data  # unset sections are not written
    assert Manifest.load(tmp_path) == m
    assert Manifest.from_dict(data).to_dict() == data


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format="other"), "format is not 'tinyserve-package'"),
    (lambda d: d.update(format_version=FORMAT_VERSION + 1), "format_version"),
    (lambda d: d.update(head_dim=0), "field 'head_dim' must be a positive int, got 0"),
    (lambda d: d.pop("vocab_size"), "field 'vocab_size' must be a positive int, got None"),
    (lambda d: d.update(dtype="int4"), "dtype must be float32 or float16"),
    (lambda d: d["io"]["inputs"].pop("page_table"), "io.inputs lacks ['page_table']"),
    (lambda d: d["io"]["layers"][0].pop("key_min"), "io.layers[0] lacks ['key_min']"),
    (lambda d: d["io"]["layers"].append(d["io"]["layers"][0]), "io.layers has 2 entries for num_layers=1"),
    (lambda d: d["io"].pop("outputs"), "io.outputs lacks 'logits'"),
    (lambda d: d.update(cold_tier={"k_granularity": "channel"}), "cold_tier must hold"),
    (lambda d: d.update(cold_tier=dict(k_granularity="x", v_granularity="token", hot_fraction=0.5, sink_pages=1,
                                       recent_pages=1, decay=0.9)), "cold_tier: k_granularity must be one of"),
    (lambda d: d.update(cold_tier=dict(k_granularity="channel", v_granularity="token", hot_fraction=0.5,
                                       sink_pages=1, recent_pages=1, decay=0.9)), "lacks the cold-tier inputs"),
    (lambda d: d.update(ort_optimized={"file": "x"}), "ort_optimized must hold"),
    (lambda d: d.update(ort_optimized={"file": "x", "onnxruntime": "1.0", "opset": "21"}),
     "ort_optimized.opset must be a positive int, got '21'"),
    # an INT4 package from before keys moved onto the page bounds (no version: symmetric keys)
    (lambda d: d.update(cold_tier=dict(k_granularity="channel", v_granularity="token", hot_fraction=0.5,
                                       sink_pages=1, recent_pages=1, decay=0.9, cold_format="int4",
                                       group_size=16)), "INT4 cold-page format version 1, this tinyserve reads 3"),
    # format 2 (symmetric V, keys on the page bounds in two-level packages too): its bytes differ
    (lambda d: d.update(cold_tier=dict(k_granularity="channel", v_granularity="token", hot_fraction=0.5,
                                       sink_pages=1, recent_pages=1, decay=0.9, cold_format="int4",
                                       cold_format_version=2)), "INT4 cold-page format version 2, this tinyserve reads 3"),
    (lambda d: d.update(cold_tier=dict(k_granularity="channel", v_granularity="token", hot_fraction=0.5,
                                       sink_pages=1, recent_pages=1, decay=0.9, cold_format="int4",
                                       cold_format_version=4)), "re-export the package with --cold-pages int4"),
])
def test_bad_manifest_is_one_line_naming_the_file(tmp_path, change, message):
    data = manifest().to_dict()
    change(data)
    pkg = package(tmp_path, data)
    with pytest.raises(PackageError) as err:
        Manifest.load(pkg)
    text = str(err.value)
    assert message in text and text.startswith(str(pkg)) and "\n" not in text


def test_int4_cold_tier_records_its_format_version(tmp_path):
    cold = ColdTier(k_granularity="channel", v_granularity="token", hot_fraction=0.5, sink_pages=1,
                    recent_pages=2, decay=0.9, cold_format="int4", group_size=16)
    assert cold.cold_format_version == INT4_FORMAT_VERSION
    io = PackageIO(manifest().io.inputs, {"logits": "logits"}, [{**LAYER, **COLD}])
    manifest(io=io, cold_tier=cold).save(tmp_path)
    (tmp_path / "model.onnx").write_bytes(b"")
    data = json.loads((tmp_path / MANIFEST_FILE).read_text())
    assert data["cold_tier"]["cold_format_version"] == INT4_FORMAT_VERSION
    assert Manifest.load(tmp_path).cold_tier == cold


def test_missing_pieces(tmp_path):
    with pytest.raises(PackageError, match="not a directory"):
        Manifest.load(tmp_path / "nope")
    with pytest.raises(PackageError, match="no tinyserve.json"):
        Manifest.load(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text("{")
    with pytest.raises(PackageError, match="not valid JSON"):
        Manifest.load(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(manifest().to_dict()))
    with pytest.raises(PackageError, match="model.onnx is missing"):
        Manifest.load(tmp_path)


def test_constructing_a_bad_manifest_fails_too():
    with pytest.raises(PackageError, match="page_size"):
        manifest(page_size=0)
    with pytest.raises(PackageError, match="token_budget"):
        replace(manifest(), token_budget=-1)


def _int4_tier(**kw) -> dict:
    return dict(k_granularity="channel", v_granularity="token", hot_fraction=0.5, sink_pages=1, recent_pages=1,
                decay=0.9, cold_format="int4", group_size=16, cold_format_version=INT4_FORMAT_VERSION, **kw)


@pytest.mark.parametrize("tier, message", [
    (_int4_tier(int8_layers=[1]), "cold_tier: int8_layers [1] out of range for num_layers=1"),
    (_int4_tier(int8_layers=[0, 0]), "cold_tier: int8_layers has duplicates: [0, 0]"),
    (_int4_tier(int8_layers=[-1]), "cold_tier: int8_layers must hold layer indices >= 0"),
    (_int4_tier(int8_layers="0"), "cold_tier: int8_layers must be a list of layer indices"),
    ({**_int4_tier(int8_layers=[0]), "cold_format": "int8", "group_size": 0},
     "cold_tier: int8_layers applies to int4 cold pages only"),
])
def test_bad_int8_layers_are_one_line(tmp_path, tier, message):
    data = manifest().to_dict()
    data["io"]["layers"][0].update(COLD)
    data["cold_tier"] = tier
    with pytest.raises(PackageError) as err:
        Manifest.load(package(tmp_path, data))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_int8_layers_round_trip_and_absent_means_none(tmp_path):
    io = PackageIO(manifest().io.inputs, {"logits": "logits"}, [{**LAYER, **COLD}, {**LAYER, **COLD}])
    cold = ColdTier(**{**_int4_tier(int8_layers=[1]), "cold_format_version": None})
    manifest(io=io, num_layers=2, cold_tier=cold).save(tmp_path)
    (tmp_path / "model.onnx").write_bytes(b"")
    assert json.loads((tmp_path / MANIFEST_FILE).read_text())["cold_tier"]["int8_layers"] == [1]
    assert Manifest.load(tmp_path).cold_tier.int8_layers == [1]
    data = json.loads((tmp_path / MANIFEST_FILE).read_text())
    del data["cold_tier"]["int8_layers"]  # a package from before the field
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(data))
    assert Manifest.load(tmp_path).cold_tier.int8_layers == []


def test_int8_layers_kl_is_checked(tmp_path):
    base = dict(k_granularity="channel", v_granularity="token", hot_fraction=0.15, sink_pages=1, recent_pages=2,
                decay=0.9, cold_format="int4", group_size=16, int8_layers=[0])
    io = PackageIO(manifest().io.inputs, {"logits": "logits"}, [{**LAYER, **COLD}])
    cold = ColdTier(**base, int8_layers_source="auto", int8_layers_kl=[2e-4])
    manifest(io=io, cold_tier=cold).save(tmp_path)
    (tmp_path / "model.onnx").write_bytes(b"")
    assert Manifest.load(tmp_path).cold_tier.int8_layers_kl == [2e-4]
    for bad, message in (([-1.0], "int8_layers_kl must be a list of numbers >= 0"),
                         ("x", "int8_layers_kl must be a list"), ([1e-4, 2e-4], "int8_layers_kl has 2 entries")):
        with pytest.raises(PackageError, match=message):
            manifest(io=io, cold_tier=ColdTier(**base, int8_layers_kl=bad))
