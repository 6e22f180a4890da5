"""The ORT graph's plan (issue #32): one typed record in the manifest, checked field by field, and
packages written before it (untyped ``validation`` keys, flat ``ort_optimized`` notes) still load."""

from __future__ import annotations

import pytest

from tinyserve_trt.contracts.manifest import OrtOptimized, PackageError
from tinyserve_trt.contracts.ort_plan import OrtGraphPlan


def test_the_plan_round_trips_inside_ort_optimized_and_its_readers_see_it():
    plan = OrtGraphPlan(21, True, "tinyserve.cpu", 2)
    opt = OrtOptimized(file="model.ort.onnx", onnxruntime="1.31", plan=plan)
    data = {"file": "model.ort.onnx", "onnxruntime": "1.31", "plan": plan.to_dict()}
    assert OrtOptimized.from_dict(data) == opt
    assert (opt.opset, opt.native, opt.native_note, opt.opset_note) == (21, "tinyserve.cpu", None, None)
    kept = OrtGraphPlan(17, native_why="package exported with --no-native-decode", opset_why="kept at 17: why")
    assert OrtGraphPlan.from_dict(kept.to_dict()) == kept and not kept.native


@pytest.mark.parametrize("data, message", [
    ({"contrib_fusions": True}, "with 'opset'"),
    ({"opset": 21, "fused": True}, "unknown fields"),
    ({"opset": 0}, "opset must be a positive int"),
    ({"opset": 21, "contrib_fusions": "yes"}, "contrib_fusions must be a bool"),
    ({"opset": 21, "native_version": 2}, "native_version without native_domain"),
    ({"opset": 21, "native_domain": "tinyserve.cpu", "native_why": "x"}, "does not call the native node"),
    ({"opset": 21, "fusions_why": "x"}, "without the contrib fusions"),
    ({"opset": 21, "native_why": "two\nlines"}, "one-line string"),
])
def test_a_bad_plan_field_is_one_line_naming_it(data, message):
    with pytest.raises(PackageError, match=message):
        OrtGraphPlan.from_dict(data)


def test_a_package_from_before_the_plan_loads_with_its_old_fields():
    old = {"file": "model.ort.onnx", "onnxruntime": "1.31", "opset": 17, "opset_note": "kept at 17: why",
           "native": None, "native_note": None}
    opt = OrtOptimized.from_dict(old, {"ort_contrib_ops": False, "ort_native_check": "skipped: no compiler"})
    assert (opt.opset, opt.opset_note, opt.native) == (17, "kept at 17: why", None)
    assert not opt.plan.contrib_fusions and opt.plan.native_version is None
    assert "skipped: no compiler" in opt.native_note
    native = OrtOptimized.from_dict({"file": "model.ort.onnx", "onnxruntime": "1.31", "native": "tinyserve.cpu"})
    assert native.native == "tinyserve.cpu" and native.plan.native_version is None  # read from the graph
    older = OrtOptimized.from_dict({"file": "model.ort.onnx", "onnxruntime": "1.31"})
    assert older.opset is None and "does not call the native kernel" in older.native_note
