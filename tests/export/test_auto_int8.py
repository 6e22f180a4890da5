"""``--int8-layers auto`` (issue #17): an INT4 export without calibration picks its INT8 layers by
the layer sensitivity pass on its own all-INT4 package over the built-in text.

The tiny LLaMA's dense layer 0 reads every cold page every step and is the sensitive one; a copy
whose layer 1 attention is scaled up (and layer 0's down) must flip the pick - the pass measures
the model, it does not default to a layer. The pick is checked against a direct call of
``layer_sensitivity`` on the same all-INT4 package and prompts.
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import onnx
import pytest

from tinyserve_trt.contracts.cold_tier import default_int8_layers_count
from tinyserve_trt.export import cli
from tinyserve_trt.export.config import ExportConfig
from tinyserve_trt.ops import schema
from tinyserve_trt.ops.node import node_attributes

AUTO = "auto: layer sensitivity on the built-in text, 2 prompts"
BASE = dict(page_size=4, token_budget=16, dense_layers=1, cold_pages=True)


def _export(src, pkg, **kw):
    from tinyserve_trt.export.pipeline import export_model

    config = ExportConfig(**{**BASE, **kw})
    return export_model(src, pkg, config, quiet=True), config, json.loads((pkg / "tinyserve.json").read_text())


def _direct_pass(src, tmp_path):
    """Per-layer KL and pick of ``layer_sensitivity`` called directly on an all-INT4 package of ``src``."""
    from tinyserve_trt.calibration.engine_source import EngineSource
    from tinyserve_trt.calibration.int8_pick import PASS_POSITIONS, pass_config, pass_prompts
    from tinyserve_trt.calibration.sensitivity import layer_sensitivity, most_sensitive

    _export(src, tmp_path / "all-int4", int8_layers="none", validate=False)
    source = EngineSource(str(tmp_path / "all-int4"))
    kl = layer_sensitivity(source, pass_prompts(source), pass_config(source, 2048), positions=PASS_POSITIONS)
    return kl, most_sensitive(kl, default_int8_layers_count(source.num_layers))


@pytest.fixture(scope="module")
def sensitive_layer1(tmp_path_factory):
    """The tiny LLaMA (same seed) with layer 1's attention output x30 and layer 0's x0.01."""
    pytest.importorskip("torch")
    from tests.tiny_models import export_source

    def edit(model):
        model.model.layers[0].self_attn.o_proj.weight *= 0.01
        model.model.layers[1].self_attn.o_proj.weight *= 30

    return export_source("llama", tmp_path_factory.mktemp("sensitive") / "src", edit=edit)


def test_the_default_int4_export_keeps_the_layers_the_pass_ranks_first(llama, tmp_path):
    from tinyserve_trt.export.report import print_summary

    src = llama[0]
    report, config, manifest = _export(src, tmp_path / "pkg")  # validated, as usual
    tier = manifest["cold_tier"]
    kl, want = _direct_pass(src, tmp_path)
    assert config.int8_layers is None and config.runs_int8_pass()
    assert tier["int8_layers"] == want == [0] and report.int8_layers == (0,)  # the dense layer, on this model
    assert tier["int8_layers_source"] == AUTO == report.int8_layers_source
    np.testing.assert_allclose(tier["int8_layers_kl"], kl, rtol=1e-6)
    assert kl[0] > kl[1] > 0  # the ranking the pick follows (the margin depends on the built-in text: 1.5x since it was regenerated from the session-12 docs, 10x+ before)
    assert manifest["validation"]["max_abs_logit_diff"] <= config.tolerance()
    model = onnx.load(str(tmp_path / "pkg" / "model.onnx"), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == schema.OP_TYPE]  # the picked layer INT8, the rest INT4
    assert [node_attributes(n).cold_format for n in nodes] == ["int8", "int4"]
    assert [schema.overload_cold_format(n.overload) for n in nodes] == ["int8", "int4"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_summary(report, config)
    lines = out.getvalue().splitlines()
    assert f"int8 layers 0 ({AUTO})" in next(ln for ln in lines if ln.startswith("cold page"))
    assert "int8 layers" in next(ln for ln in lines if ln.startswith("time")) and "int8 layers" in report.seconds


def test_the_pass_follows_the_model(sensitive_layer1, tmp_path):
    _, _, manifest = _export(sensitive_layer1, tmp_path / "pkg", validate=False)
    kl, want = _direct_pass(sensitive_layer1, tmp_path)
    assert manifest["cold_tier"]["int8_layers"] == want == [1]
    assert kl[1] > 10 * kl[0]
    np.testing.assert_allclose(manifest["cold_tier"]["int8_layers_kl"], kl, rtol=1e-6)


def test_int8_layers_none_skips_the_pass(llama, tmp_path, monkeypatch):
    from tinyserve_trt.calibration import int8_pick

    def fail(*a, **k):
        raise AssertionError("the pass ran")

    monkeypatch.setattr(int8_pick, "pick_int8_layers", fail)
    report, _, manifest = _export(llama[0], tmp_path / "pkg", int8_layers="none", validate=False)
    tier = manifest["cold_tier"]
    assert tier["int8_layers"] == [] and tier["int8_layers_source"] == "--int8-layers none"
    assert tier["int8_layers_kl"] is None and "int8 layers" not in report.seconds
    # so does a calibration artifact (its own pass), an explicit list, and an int8 tier
    for kw in (dict(int8_layers=(1,)), dict(cold_format="int8")):
        report, _, manifest = _export(llama[0], tmp_path / f"pkg-{len(kw)}-{list(kw)[0]}", validate=False, **kw)
        assert "int8 layers" not in report.seconds


def test_cli_progress_summary_and_a_failing_pass(capsys, llama, tmp_path, monkeypatch):
    code = cli.main([str(llama[0]), "-o", str(tmp_path / "pkg"), "--page-size", "4", "--cold-pages", "int4",
                     "--no-validate"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "tinyserve-export: picking INT8 layers: writing the package with every layer INT4" in err
    assert f"tinyserve-export: picking INT8 layers: 0 ({AUTO};" in err
    assert f"int8 layers 0 ({AUTO})" in out
    from tinyserve_trt.calibration import int8_pick

    def broken(*a, **k):
        raise RuntimeError("no memory\nsecond line")

    monkeypatch.setattr(int8_pick, "pick_int8_layers", broken)
    code = cli.main([str(llama[0]), "-o", str(tmp_path / "pkg2"), "-q", "--page-size", "4", "--cold-pages",
                     "int4", "--no-validate"])
    _, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 3 and len(lines) == 1 and "picking INT8 layers failed" in lines[0] and "no memory" in lines[0]
    assert "--int8-layers none" in lines[0] and not (tmp_path / "pkg2").exists()


def test_auto_needs_an_int4_tier(capsys, llama, tmp_path):
    for flags, message in ((("--cold-pages", "int8"), "int8 layers apply to int4 cold pages only"),
                           ((), "int8 layers need a cold tier")):
        code = cli.main([str(llama[0]), "-o", str(tmp_path / "out"), "-q", "--int8-layers", "auto", *flags])
        _, err = capsys.readouterr()
        assert code == 2 and message in err, err


def test_the_pass_fits_a_short_max_context(llama, tmp_path):
    from tinyserve_trt.calibration.engine_source import EngineSource
    from tinyserve_trt.calibration.int8_pick import pass_prompts

    _, _, manifest = _export(llama[0], tmp_path / "pkg", max_context=64, validate=False)
    assert manifest["max_context"] == 64 and manifest["cold_tier"]["int8_layers_source"].startswith("auto")
    source = EngineSource(str(tmp_path / "pkg"))
    assert [len(p) for p in pass_prompts(source)] == [62, 62]  # + two slots the tail's request runs past the prompt
    assert [len(p) for p in pass_prompts(source, 3, 16)] == [16, 16, 16]


def test_which_exports_run_the_pass(tmp_path):
    cal = str(tmp_path / "cal.json")  # only named: the config does not read it
    runs = {name: ExportConfig(**kw).runs_int8_pass() for name, kw in {
        "int4 default": dict(cold_pages=True),
        "int4 auto with calibration": dict(calibration=cal, int8_layers="auto"),
        "calibration": dict(calibration=cal),
        "none": dict(cold_pages=True, int8_layers="none"),
        "dense": dict(cold_pages=True, int8_layers="dense"),
        "indices": dict(cold_pages=True, int8_layers=(3,)),
        "int8": dict(cold_pages=True, cold_format="int8"),
        "trt": dict(cold_pages=True, backend="trt"),
        "no tier": dict(),
    }.items()}
    assert [k for k, v in runs.items() if v] == ["int4 default", "int4 auto with calibration"]
    config = ExportConfig(cold_pages=True)
    with pytest.raises(ValueError, match="need the sensitivity pass's result"):
        config.resolved_int8_layers(30)
    assert config.resolved_int8_layers(30, measured=((23, 18), AUTO)) == ((18, 23), AUTO)
    with pytest.raises(ValueError, match="out of range"):
        config.resolved_int8_layers(4, measured=((5,), AUTO))
