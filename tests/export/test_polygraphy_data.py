"""The Polygraphy data loader: valid paged feeds the rewritten model runs on (ORT side of the comparison)."""

from __future__ import annotations

import importlib.util

import numpy as np
import onnxruntime as ort
import pytest

from tinyserve_trt.export import polygraphy_data


@pytest.mark.parametrize("batch, context", [(1, 9), (3, 40)])
def test_feeds_are_valid_and_run(llama, batch, context):
    _, pkg, manifest = llama
    feeds = polygraphy_data.decode_feeds(pkg, batch=batch, context=context, seed=batch)
    io, ps = manifest["io"], manifest["page_size"]
    lens, table = feeds[io["inputs"]["past_lens"]], feeds[io["inputs"]["page_table"]]
    assert lens.max() == context and table.shape[0] == batch
    for b in range(batch):  # every cached token and this step's token have a distinct page
        used = table[b, : lens[b] // ps + 1]
        assert len(set(used.tolist())) == len(used)
    layer = io["layers"][0]
    k, kmin, kmax = (feeds[layer[r]] for r in ("key_cache", "key_min", "key_max"))
    for b in range(batch):
        for j in range(-(-int(lens[b]) // ps)):
            valid = min(ps, int(lens[b]) - j * ps)
            page = k[table[b, j], :, :valid]
            assert (kmin[table[b, j]][:, None] <= page).all() and (page <= kmax[table[b, j]][:, None]).all()
    sess = ort.InferenceSession(str(pkg / "model.onnx"), providers=["CPUExecutionProvider"])
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    assert out[io["outputs"]["logits"]].shape[0] == batch and np.isfinite(out[io["outputs"]["logits"]]).all()


def test_load_data_by_path_and_shape_flags(llama, monkeypatch, capsys):
    _, pkg, _ = llama
    spec = importlib.util.spec_from_file_location("loader", polygraphy_data.__file__)  # as Polygraphy loads it
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delenv("TINYSERVE_PACKAGE", raising=False)
    with pytest.raises(RuntimeError, match="TINYSERVE_PACKAGE"):
        next(module.load_data())
    monkeypatch.setenv("TINYSERVE_PACKAGE", str(pkg))
    monkeypatch.setenv("TINYSERVE_BATCH", "2")
    (feeds,) = list(module.load_data())
    assert polygraphy_data.main([str(pkg), "--shape-flags"]) == 0
    flags = capsys.readouterr().out
    assert flags.count("--trt-") == 3 and f"page_table:[2,{feeds['page_table'].shape[1]}]" in flags
    assert polygraphy_data.main([str(pkg / "missing")]) == 2
