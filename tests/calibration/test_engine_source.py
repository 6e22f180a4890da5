"""The ``engine`` calibration source (a tinyserve package on the runtime) and the CLI around it.

Uses the session's tiny LLaMA package (``tests/conftest.py``: page size 4, token budget 16,
one dense leading layer, single-level query_aware); the HF comparison re-creates the same
seeded model as a Hugging Face directory.
"""

import json

import numpy as np
import pytest

from tinyserve_trt.calibration.cli import main
from tinyserve_trt.calibration.source import detect_source

PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 250, 37)]


@pytest.fixture(scope="module")
def engine_source(llama):
    from tinyserve_trt.calibration.source import make_source

    src = make_source("engine", str(llama[1]), decode_steps=4, threads=1)
    yield src
    src.close()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The tiny LLaMA of the ``llama`` package as a Hugging Face directory (same config and seed)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.tiny_models import VOCAB, write_byte_tokenizer
    from tinyserve_dev.models.tiny_models import TinyModelConfig, build_tiny_model

    out = tmp_path_factory.mktemp("llama-hf")
    build_tiny_model(TinyModelConfig(kind="llama", vocab_size=VOCAB, max_positions=512, seed=0)).save_pretrained(out)
    write_byte_tokenizer(out)
    return out


def test_detect_source(tmp_path, llama, hf_dir):
    assert detect_source(llama[1]) == "engine"
    assert detect_source(hf_dir) == "hf"
    with pytest.raises(ValueError, match="neither a tinyserve package"):
        detect_source(tmp_path)
    with pytest.raises(ValueError, match="no such directory"):
        detect_source(tmp_path / "missing")


def test_engine_kv_and_selections_match_the_hf_source(engine_source, hf_dir, llama):
    """Same prompt through the package's engine and the HF model: the pool's K/V (after rotary) equal
    the captured ones, and the op's selections at the decode steps equal the numpy replay over the
    HF queries and keys for the sparse layer (layer 0 is dense in the package: every page)."""
    from tinyserve_trt.calibration.hf_source import HFSource
    from tinyserve_trt.ops import schema

    manifest = llama[2]
    assert (manifest["page_size"], manifest["token_budget"], manifest["dense_layers"], manifest["sub_page_size"]) \
        == (4, 16, 1, 0)
    rule = engine_source.op_settings()  # the package's selection rule: per query head by default
    assert rule["group_reduce"] == manifest["group_reduce"]
    hf = HFSource(str(hf_dir), page_size=4, token_budget=16, decode_steps=4,
                  attrs=schema.OpAttributes(sink_pages=manifest["sink_pages"], recent_pages=manifest["recent_pages"],
                                            group_reduce=rule["group_reduce"],
                                            candidate_share=rule["candidate_share"]))
    assert engine_source.max_context == manifest["max_context"]  # the CLI cuts prompts to it
    a, b = engine_source.observe(PROMPT), hf.observe(PROMPT)
    assert a.keys.shape == b.keys.shape == (2, 2, len(PROMPT), 16)
    np.testing.assert_allclose(a.keys, b.keys, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(a.values, b.values, rtol=1e-4, atol=1e-4)
    assert a.selected_pages.shape == b.selected_pages.shape == (4, 2, 2, 9)
    np.testing.assert_array_equal(a.selected_pages[:, 1], b.selected_pages[:, 1])
    for i, t in enumerate(range(len(PROMPT) - 4, len(PROMPT))):  # dense layer: all of the step's past pages
        n = -(-t // 4)
        assert a.selected_pages[i, 0, :, :n].all() and not a.selected_pages[i, 0, :, n:].any()
    # the budget selects, not everything: 16 // 4 pages per query head, a KV head's row their union
    G = manifest["num_heads"] // manifest["num_kv_heads"]
    kept = a.selected_pages[:, 1].sum(axis=-1)  # [steps, Hkv]
    assert 0 < kept.max() <= G * (16 // 4)
    assert all((kept[i] < -(-t // 4)).all() for i, t in enumerate(range(len(PROMPT) - 4, len(PROMPT))))


def test_two_level_package_selections_match_the_hf_replay(hf_dir, tmp_path_factory):
    """A two-level package (page 8, sub-pages of 4): the op's selections in the engine equal the HF
    source's replay with the package's sub-page size and dense layers (calibration observes the
    selection the op makes; the replay ran single level before)."""
    from tests.tiny_models import build_package
    from tinyserve_trt.calibration.hf_source import HFSource
    from tinyserve_trt.calibration.source import make_source

    _, pkg = build_package("llama", tmp_path_factory.mktemp("two-level"), page_size=8, sub_page_size=4)
    manifest = json.loads((pkg / "tinyserve.json").read_text())
    assert (manifest["page_size"], manifest["sub_page_size"], manifest["dense_layers"]) == (8, 4, 1)
    prompt = [int(t) for t in np.random.default_rng(8).integers(3, 250, 150)]  # 19 pages, 5 in the budget
    src = make_source("engine", str(pkg), decode_steps=4, threads=1, token_budget=40)
    try:
        a = src.observe(prompt)
        settings = src.op_settings()
    finally:
        src.close()
    hf = HFSource(str(hf_dir), page_size=8, token_budget=40, decode_steps=4,
                  sub_page_size=settings["sub_page_size"], dense_layers=settings["dense_layers"],
                  group_reduce=settings["group_reduce"], candidate_share=settings["candidate_share"])
    b = hf.observe(prompt)
    assert a.selected_pages.shape == b.selected_pages.shape
    np.testing.assert_array_equal(a.selected_pages, b.selected_pages)
    single = HFSource(str(hf_dir), page_size=8, token_budget=40, decode_steps=4, dense_layers=1,
                      group_reduce=settings["group_reduce"],
                      candidate_share=settings["candidate_share"]).observe(prompt)
    assert not np.array_equal(single.selected_pages, b.selected_pages)  # the case tells the rules apart


def test_next_token_logits_read_the_transformed_pool(engine_source, llama):
    """No transform: the logits the engine serves with (LLM's greedy second token after its first);
    an identity transform changes nothing; zeroing the values changes the logits (the pool's pages
    really were rewritten)."""
    from tinyserve_trt.runtime import LLM, SamplingParams

    base = engine_source.next_token_logits(PROMPT)
    assert base.dtype == np.float64 and base.shape == (256,)
    np.testing.assert_array_equal(engine_source.next_token_logits(PROMPT, lambda layer, k, v: (k, v)), base)
    zeroed = engine_source.next_token_logits(PROMPT, lambda layer, k, v: (k, np.zeros_like(v)))
    assert np.abs(zeroed - base).max() > 1e-3
    with LLM(llama[1], threads=1) as llm:  # the same prompt (all but the last token) served normally
        out = llm.generate(prompt_token_ids=PROMPT[:-1], params=SamplingParams(temperature=0, max_tokens=2))
    assert engine_source.next_token_logits(PROMPT[:-1] + [out[0].outputs[0].token_ids[0]]).argmax() == \
        out[0].outputs[0].token_ids[1]


def test_next_token_logits_many_equals_one_request_per_transform(engine_source):
    """One prefill, the last step run once per transform from a restored snapshot: the same logits as
    a fresh request per transform, in order - a transform must not leak into the next one's run."""
    transforms = [None, lambda layer, k, v: (k, np.zeros_like(v)), None,
                  lambda layer, k, v: (k * (2.0 if layer == 1 else 1.0), v)]
    many = engine_source.next_token_logits_many(PROMPT, transforms)
    assert len(many) == len(transforms)
    for got, t in zip(many, transforms):
        np.testing.assert_allclose(got, engine_source.next_token_logits(PROMPT, t), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(many[0], many[2])  # the zeroed values were restored in between
    assert np.abs(many[1] - many[0]).max() > 1e-3 and np.abs(many[3] - many[0]).max() > 1e-3


def _prompts(path, n=4):
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()
    path.write_text("\n".join(" ".join(words[i:] + words[:i]) * 2 for i in range(n)) + "\n")
    return path


def test_cli_round_trip_package_to_calibrated_export(tmp_path, llama, capsys):
    """PKG -> tinyserve-calibrate (engine source picked automatically) -> calibration.json ->
    tinyserve-export --calibration: the new package carries the cold tier and the artifact."""
    from tinyserve_trt.contracts.calibration import CalibrationArtifact
    from tinyserve_trt.export.cli import main as export_main

    src, pkg, manifest = llama
    cal = tmp_path / "cal" / "calibration.json"
    assert main([str(pkg), "--data", str(_prompts(tmp_path / "p.txt")), "--samples", "2", "--heldout", "2",
                 "--decode-steps", "3", "--hot-fraction", "0.5", "-o", str(cal), "--quiet", "--threads", "1",
                 "--int8-layers-count", "1"]) == 0
    out = capsys.readouterr().out
    assert "engine source, page size 4, token budget 16" in out and "held-out 2 prompts" in out
    assert "layer sensitivity (mean KL, only that layer INT4)" in out
    art = CalibrationArtifact.load(cal)
    # a plain package: evaluated as tinyserve-export's default INT4 package, one layer kept at INT8
    assert len(art.layer_kl) == 2 and all(x >= 0 for x in art.layer_kl) and len(art.int8_layers) == 1
    assert art.int8_layers == [int(np.argmax(art.layer_kl))]
    assert art.evaluation["cold_format"] == f"int4 (int8 layers {art.int8_layers[0]})"
    assert (art.page_size, art.token_budget, art.model) == (4, 16, str(pkg))
    assert art.k_absmax.shape == (2, 2, 16) and np.all(art.k_absmax > 0) and np.all(art.v_absmax > 0)
    assert art.evaluation["num_prompts"] == 2 and art.evaluation["top1_agreement"] is not None
    assert abs(sum(art.hit_stats[k] for k in ("sink_share", "recent_share", "other_share")) - 1) < 1e-9

    out_pkg = tmp_path / "calibrated"
    assert export_main([str(src), "-o", str(out_pkg), "--page-size", "4", "--token-budget", "16",
                        "--dense-layers", "1", "--calibration", str(cal), "-q"]) == 0
    written = json.loads((out_pkg / "tinyserve.json").read_text())
    tier = written["cold_tier"]
    assert tier["hot_fraction"] == 0.5 and tier["calibration"]["file"] == "calibration.json"
    assert tier["calibration"]["model"] == str(pkg)
    assert tier["cold_format"] == "int4" and tier["int8_layers"] == art.int8_layers  # the artifact's, not dense
    assert tier["int8_layers_source"] == "from calibration (layer sensitivity)"
    np.testing.assert_array_equal(CalibrationArtifact.load(out_pkg / "calibration.json").k_absmax, art.k_absmax)


def _one_line_exit_2(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tinyserve-calibrate: error:") and needle in err, err


def test_bad_inputs_give_one_line_and_exit_2(tmp_path, llama, capsys):
    data = _prompts(tmp_path / "p.txt")
    pkg = str(llama[1])
    _one_line_exit_2(capsys, [str(tmp_path / "nope"), "--data", str(data), "--samples", "1", "--heldout", "1"],
                     "no such directory")
    (tmp_path / "empty_dir").mkdir()
    _one_line_exit_2(capsys, [str(tmp_path / "empty_dir"), "--data", str(data), "--samples", "1", "--heldout", "1"],
                     "neither a tinyserve package")
    (tmp_path / "empty.txt").write_text("")
    _one_line_exit_2(capsys, [pkg, "--data", str(tmp_path / "empty.txt")], "holds no prompts")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00\x80bad")
    _one_line_exit_2(capsys, [pkg, "--data", str(tmp_path / "bin.txt")], "cannot read data file")
    _one_line_exit_2(capsys, [pkg, "--data", str(tmp_path)], "cannot read data file")  # a directory
    _one_line_exit_2(capsys, [pkg, "--data", str(data), "--samples", "1", "--heldout", "1", "--page-size", "8"],
                     "page size is 4")
    _one_line_exit_2(capsys, [pkg, "--data", str(data), "--int8-layers-count", "-1"],
                     "int8_layers_count must be an int >= 0")
    _one_line_exit_2(capsys, [str(tmp_path / "empty_dir"), "--data", str(data), "--samples", "1", "--heldout", "1",
                              "--source", "engine"], "cannot load")


def test_tail_logits_rerun_the_last_steps_per_transform(engine_source):
    """The engine's one-prefill tail equals one request per prefix where both define the same thing:
    untransformed, every row; transformed, the first row (later rows see the transformed cache in
    the engine's K/V of the tail tokens, so they differ - by less than the transform's own effect)."""
    from dataclasses import replace

    from tinyserve_trt.calibration.int8_pick import pass_config
    from tinyserve_trt.calibration.observe import fake_quantize, heldout_cold_pages
    from tinyserve_trt.calibration.source import ObservationSource

    src = engine_source
    cfg = replace(pass_config(src, 200), hot_fraction=0.2)
    ids = [int(x) for x in np.random.default_rng(3).integers(3, 250, 120)]
    cold = heldout_cold_pages(src, ids[:len(ids) - 4 + 1], cfg)
    assert cold
    transforms = [None, fake_quantize(cfg, cold, cfg.tiers().layer_codecs(src.num_layers))]
    fast = src.tail_logits_many(ids, transforms, 4)
    slow = ObservationSource.tail_logits_many(src, ids, transforms, 4)
    assert [f.shape for f in fast] == [(4, src.package.vocab_size)] * 2
    np.testing.assert_allclose(fast[0], slow[0], atol=1e-5)
    np.testing.assert_allclose(fast[1][0], slow[1][0], atol=1e-5)
    effect = np.abs(fast[1] - fast[0]).max()
    assert effect > 1e-4 and np.abs(fast[1] - slow[1]).max() < effect
    assert np.allclose(src.next_token_logits_many(ids, transforms[:1])[0], fast[0][-1], atol=1e-5)
    with pytest.raises(ValueError, match="positions must be in"):
        src.tail_logits_many(ids, transforms, len(ids))
