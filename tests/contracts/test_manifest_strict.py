"""The manifest is untrusted input (issue #29): every field's type and range is checked, and a
malformed manifest is one PackageError line - never a TypeError or AttributeError from deeper in."""

from __future__ import annotations

import copy
import json

import pytest

from tinyserve_trt.contracts.manifest import MANIFEST_FILE, Manifest, PackageError, PackageIO
from tinyserve_trt.ops import schema

from .test_manifest import COLD, manifest, package

TIER = dict(k_granularity="channel", v_granularity="token", hot_fraction=0.5, sink_pages=1, recent_pages=1,
            decay=0.9)


def full() -> dict:
    """A manifest dict with every optional section set (the fuzz below mutates each field)."""
    data = manifest(num_layers=2, vocab_size=32, eos_token_id=[2, 3], bos_token_id=1, dense_layers=1,
                    op=dict(domain=schema.DOMAIN, name=schema.OP_TYPE, version=schema.VERSION),
                    engine=dict(file="model.plan", max_batch=8, max_new_tokens=64, max_pages=16, max_pool_pages=64,
                                max_cold_pages=0),
                    io=PackageIO(manifest().io.inputs, {"logits": "logits"},
                                 [{**_layer(0), "policy": "dense"}, {**_layer(1), "policy": "query_aware"}]),
                    ).to_dict()
    data["ort_optimized"] = dict(file="model.ort.onnx", onnxruntime="1.0", weights="model.onnx.data", opset=21,
                                 native="tinyserve.cpu", shared_bytes=10, own_bytes=0)
    data["cold_tier"] = dict(TIER, calibration={"file": "calibration.json"})
    for layer in data["io"]["layers"]:
        layer.update({k: f"{v}x" for k, v in COLD.items()})
    data["source"] = {"path": "model.onnx"}
    data["tool_version"] = "0.1.0"
    return data


def _layer(i: int) -> dict:
    return {r: f"{r}.{i}" for r in ("key_cache", "value_cache", "key_min", "key_max", "new_key", "new_value",
                                   "selected_pages")}


def _load(tmp_path, data):
    return Manifest.load(package(tmp_path, data))


def test_the_full_manifest_loads(tmp_path):
    m = _load(tmp_path, full())
    assert m.eos_token_id == [2, 3] and m.dense_layers == 1


def test_dense_layer_indices_load(tmp_path):
    data = full()
    data["dense_layers"] = [1]
    assert _load(tmp_path, data).dense_layers == [1]


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(eos_token_id=[None]), "eos_token_id must be a token id"),
    (lambda d: d.update(eos_token_id="2"), "eos_token_id must be a token id"),
    (lambda d: d.update(eos_token_id=-1), "eos_token_id must be a token id"),
    (lambda d: d.update(eos_token_id=True), "eos_token_id must be a token id"),
    (lambda d: d.update(eos_token_id=[2, 32]), "eos_token_id [2, 32] out of range for vocab_size 32"),
    (lambda d: d.update(bos_token_id=1.5), "bos_token_id must be a token id"),
    (lambda d: d.update(bos_token_id=99), "bos_token_id 99 out of range for vocab_size 32"),
    (lambda d: d["io"]["inputs"].update(input_ids=7), "io.inputs['input_ids'] must be a tensor name"),
    (lambda d: d["io"]["inputs"].update(position_ids=None), "io.inputs['position_ids'] must be a tensor name"),
    (lambda d: d["io"]["outputs"].update(logits=["x"]), "io.outputs['logits'] must be a tensor name"),
    (lambda d: d["io"]["layers"][0].update(key_cache={}), "io.layers[0]['key_cache'] must be a tensor name"),
    (lambda d: d["io"]["layers"][1].update(policy="fast"), "io.layers[1] policy must be one of"),
    (lambda d: d.update(policy="fast"), "policy must be one of"),
    (lambda d: d.update(dense_layers=3), "dense_layers must be an int in [0, 2]"),
    (lambda d: d.update(dense_layers=-1), "dense_layers must be an int in [0, 2]"),
    (lambda d: d.update(dense_layers=[0, 0]), "dense_layers repeats a layer"),
    (lambda d: d.update(dense_layers=[0, 5]), "dense_layers [5] out of range: the model has 2 layers"),
    (lambda d: d.update(dense_layers=["1"]), "dense_layers indices must be ints >= 0"),
    (lambda d: d.update(dense_layers="1"), "dense_layers must be a count or a list of layer indices"),
    (lambda d: d.update(sink_pages="1"), "sink_pages must be an int >= 0"),
    (lambda d: d.update(backend="tensorflow"), "backend must be one of"),
    (lambda d: d.update(candidate_share=2.0), "candidate_share"),
    (lambda d: d["op"].update(version=schema.VERSION + 1),
     f"op version {schema.VERSION + 1} is newer than this tinyserve's ({schema.VERSION})"),
    (lambda d: d["op"].update(version="1"), "op.version must be a positive int"),
    (lambda d: d["op"].update(domain="other"), "op is other::QueryAwareSparseAttention"),
    (lambda d: d.update(op=[1]), "op must be an object"),
    (lambda d: d["engine"].update(max_batch="8"), "engine.max_batch must be an int >= 1"),
    (lambda d: d.update(source="x"), "source must be an object"),
    (lambda d: d.update(tool_version=1), "tool_version must be a string"),
    (lambda d: d["cold_tier"].update(decay="0.9"), "cold_tier"),
    (lambda d: d["cold_tier"].update(hot_fraction=None), "cold_tier"),
    (lambda d: d["ort_optimized"].update(onnxruntime=1), "ort_optimized.onnxruntime must be a string"),
    (lambda d: d["ort_optimized"].update(shared_bytes=-1), "ort_optimized.shared_bytes must be an int >= 0"),
    (lambda d: d.update(extra_key=1) or d.update(io={"inputs": [], "layers": []}), "'io' must hold"),
])
def test_malformed_fields_are_one_line(tmp_path, change, message):
    data = full()
    change(data)
    with pytest.raises(PackageError) as err:
        _load(tmp_path, data)
    text = str(err.value)
    assert message in text and "\n" not in text and text.startswith(str(tmp_path))


def test_a_package_with_an_older_op_version_or_none_loads(tmp_path):
    data = full()
    del data["op"]
    assert _load(tmp_path, data).op is None


BAD_VALUES = (None, "x", -1, 1.5, True, [], [None], {}, {"a": None}, 10 ** 30)


def _paths(data, prefix=()):
    """Every (path of keys/indices) in ``data``, depth first."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        yield (*prefix, key)
        yield from _paths(value, (*prefix, key))


@pytest.mark.parametrize("where", list(_paths(full())), ids=lambda p: ".".join(map(str, p)))
def test_any_field_with_any_bad_value_is_a_package_error_or_loads(tmp_path, where):
    """Fuzz: each field set to values of the wrong type or range; only PackageError may come out,
    and a manifest that loads gives the runtime's token ids without raising."""
    from tinyserve_trt.runtime.model_package import ModelPackage

    for bad in BAD_VALUES:
        data = copy.deepcopy(full())
        node = data
        for key in where[:-1]:
            node = node[key]
        node[where[-1]] = bad
        (tmp_path / MANIFEST_FILE).write_text(json.dumps(data))
        (tmp_path / "model.onnx").write_bytes(b"")
        try:
            pkg = ModelPackage.load(tmp_path)
        except PackageError as e:
            assert "\n" not in str(e)
            continue
        pkg.eos_token_ids, pkg.bos_token_id, pkg.inputs, pkg.layers, pkg.logits, pkg.cold_tier  # noqa: B018
        assert all(isinstance(t, int) and 0 <= t < pkg.vocab_size for t in pkg.eos_token_ids)
