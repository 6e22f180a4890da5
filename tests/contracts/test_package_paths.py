"""Every file a package names resolves inside the package (issue #29): absolute paths, ``..``
and links that lead outside are refused with one PackageError line naming the field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tinyserve_trt.contracts.manifest import MANIFEST_FILE, Manifest, PackageError

from .test_manifest import COLD, manifest, package

TIER = dict(k_granularity="channel", v_granularity="token", hot_fraction=0.5, sink_pages=1, recent_pages=1,
            decay=0.9)


def _with(data: dict, field: str, name) -> dict:
    if field == "ort_optimized.file":
        data["ort_optimized"] = {"file": name, "onnxruntime": "1.0"}
    elif field == "ort_optimized.weights":
        data["ort_optimized"] = {"file": "model.ort.onnx", "onnxruntime": "1.0", "weights": name}
    elif field == "engine.file":
        data["engine"] = {"file": name, "max_batch": 8, "max_pages": 16}
    elif field == "cold_tier.calibration.file":
        data["io"]["layers"][0].update(COLD)
        data["cold_tier"] = dict(TIER, calibration={"file": name})
    return data


FIELDS = ("ort_optimized.file", "ort_optimized.weights", "engine.file", "cold_tier.calibration.file")


def _refused(pkg, field) -> str:
    with pytest.raises(PackageError) as err:
        Manifest.load(pkg)
    text = str(err.value)
    assert field in text and "\n" not in text
    return text


@pytest.mark.parametrize("field", FIELDS)
def test_absolute_path_is_refused(tmp_path, field):
    text = _refused(package(tmp_path, _with(manifest().to_dict(), field, "/etc/passwd")), field)
    assert "absolute" in text


@pytest.mark.parametrize("field", FIELDS)
def test_dotdot_path_is_refused(tmp_path, field):
    text = _refused(package(tmp_path, _with(manifest().to_dict(), field, "sub/../../outside.bin")), field)
    assert "'..'" in text


@pytest.mark.parametrize("field", FIELDS)
def test_a_link_inside_that_leads_outside_is_refused(tmp_path, field):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (tmp_path / "outside.bin").write_bytes(b"x")
    (pkg / "inside.bin").symlink_to(tmp_path / "outside.bin")
    text = _refused(package(pkg, _with(manifest().to_dict(), field, "inside.bin")), field)
    assert "outside the package" in text


@pytest.mark.parametrize("bad", ["", 3, None, "a\0b"])
def test_a_name_that_is_not_a_relative_file_name_is_refused(tmp_path, bad):
    data = _with(manifest().to_dict(), "engine.file", bad)
    _refused(package(tmp_path, data), "engine.file")


def test_a_link_that_stays_inside_and_a_plain_name_are_fine(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "model.plan").write_bytes(b"x")
    (tmp_path / "model.plan").symlink_to(tmp_path / "sub" / "model.plan")
    data = _with(manifest().to_dict(), "engine.file", "model.plan")
    assert Manifest.load(package(tmp_path, data)).engine["file"] == "model.plan"
    data = _with(manifest().to_dict(), "engine.file", "sub/model.plan")
    assert Manifest.load(package(tmp_path, data)).engine["file"] == "sub/model.plan"


def test_model_onnx_linked_outside_is_refused(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (tmp_path / "model.onnx").write_bytes(b"")
    (pkg / "model.onnx").symlink_to(tmp_path / "model.onnx")
    (pkg / MANIFEST_FILE).write_text(json.dumps(manifest().to_dict()))
    _refused(pkg, "model.onnx")


def test_calibration_arrays_must_be_inside_the_artifacts_folder(tmp_path):
    from tinyserve_trt.contracts.calibration import ArtifactError, CalibrationArtifact

    art = CalibrationArtifact(model="m", page_size=4, k_granularity="channel", v_granularity="token",
                              hot_fraction=0.5, k_absmax=np.ones((1, 2, 8), np.float32),
                              v_absmax=np.ones((1, 2), np.float32))
    pkg = tmp_path / "pkg"
    path = art.save(pkg / "calibration.json")
    assert CalibrationArtifact.load(path).k_absmax.shape == (1, 2, 8)
    np.savez(tmp_path / "elsewhere.npz", k_absmax=art.k_absmax, v_absmax=art.v_absmax)
    meta = json.loads(path.read_text())
    for arrays in (str(tmp_path / "elsewhere.npz"), "../elsewhere.npz"):
        path.write_text(json.dumps({**meta, "arrays": arrays}))
        with pytest.raises(ArtifactError, match="arrays") as err:
            CalibrationArtifact.load(path)
        assert "\n" not in str(err.value)
    (pkg / "link.npz").symlink_to(tmp_path / "elsewhere.npz")
    path.write_text(json.dumps({**meta, "arrays": "link.npz"}))
    with pytest.raises(ArtifactError, match="outside"):
        CalibrationArtifact.load(path)


def test_ort_model_path_stays_inside(tmp_path):
    from tinyserve_trt.runtime.model_package import ModelPackage

    (tmp_path / "model.ort.onnx").write_bytes(b"")
    data = _with(manifest().to_dict(), "ort_optimized.file", "model.ort.onnx")
    pkg = ModelPackage.load(package(tmp_path, data))
    assert pkg.ort_model_path("1.0") == tmp_path / "model.ort.onnx"
    assert pkg.ort_model_path("2.0") == tmp_path / "model.onnx"


def test_tokenizer_files_linked_outside_are_refused(tmp_path):
    from tinyserve_trt.runtime.model_package import ModelPackage

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (tmp_path / "secret.json").write_text('{"chat_template": "{{ messages }}"}')
    (pkg / "tokenizer_config.json").symlink_to(tmp_path / "secret.json")
    with pytest.raises(PackageError, match="tokenizer_config.json .*outside the package") as err:
        ModelPackage.load(package(pkg, manifest().to_dict()))  # read at load (finding 6)
    assert "\n" not in str(err.value)
