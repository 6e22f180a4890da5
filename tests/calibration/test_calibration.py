"""Calibration: artifact round trip, the CLI's bad-data exits, observe/evaluate on a fake model."""

import json

import numpy as np
import pytest

from tinyserve_trt.contracts.calibration import ArtifactError, CalibrationArtifact
from tinyserve_trt.calibration.cli import DataError, main, read_prompts
from tinyserve_trt.calibration.observe import CalibrationConfig, calibrate, cold_pages_for, fake_quantize
from tinyserve_trt.calibration.selection import replay_selection
from tinyserve_trt.calibration.source import Observation, ObservationSource
from tinyserve_trt.ops import schema

L, HKV, H, D, PS = 2, 2, 4, 8, 4


class FakeSource(ObservationSource):
    """Deterministic K/V per token; logits are a fixed linear read-out of the last token's
    attention over the (transformed) cache, so quantization changes them slightly."""

    num_layers, num_kv_heads, head_dim = L, HKV, D

    def __init__(self):
        rng = np.random.default_rng(0)
        self.emb = rng.standard_normal((100, L, HKV + H, D)).astype(np.float32)
        self.out = rng.standard_normal((H * D, 50))

    def tokenize(self, text):
        return [ord(c) % 100 for c in text]

    def _qkv(self, ids):
        e = self.emb[np.asarray(ids)]  # [T, L, HKV+H, D]
        k = np.transpose(e[:, :, :HKV], (1, 2, 0, 3))
        q = np.transpose(e[:, :, HKV:], (1, 2, 0, 3))
        return q, k, -k

    def observe(self, ids):
        q, k, v = self._qkv(ids)
        sel = replay_selection(q, k, range(max(1, len(ids) - 3), len(ids)), PS, 2 * PS, schema.OpAttributes())
        return Observation(keys=k, values=v, selected_pages=sel)

    def next_token_logits(self, ids, transform=None):
        q, k, v = self._qkv(ids)
        outs = []
        for layer in range(L):
            kl, vl = (k[layer], v[layer]) if transform is None else transform(layer, k[layer], v[layer])
            for h in range(H):
                s = kl[h // 2] @ q[layer, h, -1]
                p = np.exp(s - s.max())
                outs.append((p / p.sum()) @ vl[h // 2])
        return (np.mean(np.stack(outs).reshape(L, H * D), axis=0) @ self.out).astype(np.float64)


def _artifact():
    rng = np.random.default_rng(1)
    return CalibrationArtifact(model="m", page_size=16, k_granularity="channel", v_granularity="token",
                               hot_fraction=0.25, k_absmax=rng.random((3, 2, 8)).astype(np.float32),
                               v_absmax=rng.random((3, 2)).astype(np.float32), hit_stats={"sink_share": 0.5},
                               evaluation={"top1_agreement": 1.0})


def test_artifact_round_trip(tmp_path):
    a = _artifact()
    path = a.save(tmp_path / "sub" / "cal.json")
    assert (tmp_path / "sub" / "cal.npz").exists()
    b = CalibrationArtifact.load(path)
    np.testing.assert_array_equal(a.k_absmax, b.k_absmax)
    np.testing.assert_array_equal(a.v_absmax, b.v_absmax)
    assert (b.hot_fraction, b.hit_stats, b.evaluation, b.k_granularity) == (0.25, {"sink_share": 0.5},
                                                                           {"top1_agreement": 1.0}, "channel")
    tiers, hot = b.tier_config(64), b.hotness_config()
    assert (tiers.num_cold_pages, tiers.k_granularity, hot.hot_fraction) == (64, "channel", 0.25)
    ks, vs = b.static_scales()
    assert ks.shape == (3, 2, 1, 8) and vs.shape == (3, 2, 1, 1)


def test_artifact_load_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ArtifactError, match="cannot read"):
        CalibrationArtifact.load(bad)
    bad.write_text(json.dumps({"version": 99}))
    with pytest.raises(ArtifactError, match="version-1"):
        CalibrationArtifact.load(bad)
    path = _artifact().save(tmp_path / "a.json")
    path.with_suffix(".npz").unlink()
    with pytest.raises(ArtifactError, match="incomplete"):
        CalibrationArtifact.load(path)


def test_read_prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "a b"}\n\n{"prompt": "c"}\n')
    assert read_prompts(f) == ["a b", "c"]
    t = tmp_path / "p.txt"
    t.write_text("one\n\ntwo\n")
    assert read_prompts(t) == ["one", "two"]
    f.write_text('{"text": "a"}\n[1, 2]\n')
    with pytest.raises(DataError, match=":2: expected an object"):
        read_prompts(f)


@pytest.mark.parametrize("content,suffix,msg", [
    (None, ".jsonl", "cannot read data file"),
    ("{oops\n", ".jsonl", "not JSON"),
    ("\n\n", ".txt", "holds no prompts"),
    ("only one\n", ".txt", "--samples 16"),
    (b"\xff\xfe\x00bad", ".txt", "cannot read data file"),
])
def test_bad_data_file_exits_2_with_one_line(tmp_path, capsys, content, suffix, msg):
    data = tmp_path / f"data{suffix}"
    if isinstance(content, bytes):
        data.write_bytes(content)
    elif content is not None:
        data.write_text(content)
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path), "--data", str(data)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tinyserve-calibrate: error:") and msg in err


def test_unknown_source_exits_2(tmp_path, capsys):
    data = tmp_path / "p.txt"
    data.write_text("a\nb\n")
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path), "--data", str(data), "--samples", "1", "--heldout", "1", "--source", "nope"])
    assert exc.value.code == 2 and "unknown calibration source" in capsys.readouterr().err


def test_cold_pages_follow_the_runtime_rules():
    cfg = CalibrationConfig(page_size=PS, sink_pages=1, hot_recent_pages=2, hot_fraction=0.5)
    sel = np.zeros((1, 1, 1, 10), bool)
    sel[..., [3, 4]] = True
    cold = cold_pages_for(sel, 10, cfg)
    assert cold == [1, 2, 5, 6, 7]  # 5 of 10 cold: unhit first; never 0 (sink) nor 8, 9 (recent)
    assert cold_pages_for(sel, 10, CalibrationConfig(page_size=PS, hot_fraction=0.0)) == [1, 2, 3, 4, 5, 6, 7]


def test_fake_quantize_leaves_hot_and_partial_pages_alone():
    cfg = CalibrationConfig(page_size=PS, cold_format="int8", group_size=0)
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 10, 3)), rng.standard_normal((2, 10, 3))
    k2, v2 = fake_quantize(cfg, [0, 2])(0, k, v)  # page 2 is partial (tokens 8, 9)
    np.testing.assert_array_equal(k2[:, 4:], k[:, 4:])
    assert not np.array_equal(k2[:, :4], k[:, :4]) and np.allclose(k2[:, :4], k[:, :4], atol=0.05)


def test_calibrate_on_a_fake_model(tmp_path):
    src = FakeSource()
    prompts = [src.tokenize(t) for t in ("the quick brown fox jumps over the lazy dog" * 2,
                                         "pack my box with five dozen liquor jugs" * 2, "sphinx of black quartz")]
    cfg = CalibrationConfig(page_size=PS, token_budget=2 * PS, hot_fraction=0.25, cold_format="int8", group_size=0)
    art = calibrate(src, prompts[:2], prompts[2:], cfg, model="fake")
    assert art.int8_layers is None and art.layer_kl == []  # INT8: no sensitivity pass
    assert art.k_absmax.shape == (L, HKV, D) and np.all(art.k_absmax > 0)
    assert sum(v for k, v in art.hit_stats.items() if k != "top10_share") == pytest.approx(1.0)
    ev = art.evaluation
    assert ev["num_prompts"] == 1 and 0 < ev["memory_saved"] < 1 and ev["top1_agreement"] in (0.0, 1.0)
    assert ev["mean_kl"] >= 0
    again = CalibrationArtifact.load(art.save(tmp_path / "c.json"))
    assert again.evaluation == ev


def test_replayed_selection_is_the_ops():
    from tinyserve_trt.ops import sparse_attention_ref

    rng = np.random.default_rng(3)
    T = 37
    q = rng.standard_normal((1, H, T, D)).astype(np.float32)
    k = rng.standard_normal((1, HKV, T, D)).astype(np.float32)
    attrs = schema.OpAttributes(sink_pages=1, recent_pages=1)
    positions = [9, 20, 36]
    sel = replay_selection(q, k, positions, PS, 3 * PS, attrs)
    for i, t in enumerate(positions):
        n = -(-t // PS)
        pages = np.zeros((n * PS, HKV, D), np.float32)
        pages[:t] = np.swapaxes(k[0, :, :t], 0, 1)
        cache = np.transpose(pages.reshape(n, PS, HKV, D), (0, 2, 1, 3)).copy()  # [n, Hkv, ps, D]
        kmin = np.stack([np.swapaxes(k[0, :, j * PS:min(t, (j + 1) * PS)], 0, 1).min(0) for j in range(n)])
        kmax = np.stack([np.swapaxes(k[0, :, j * PS:min(t, (j + 1) * PS)], 0, 1).max(0) for j in range(n)])
        _, ref = sparse_attention_ref(q[:, :, t:t + 1], k[:, :, t:t + 1], k[:, :, t:t + 1], cache, cache, kmin, kmax,
                                      np.arange(n, dtype=np.int32)[None], np.array([t], np.int32),
                                      np.array([3 * PS], np.int32), attrs=attrs)
        np.testing.assert_array_equal(sel[i, 0, :, :n], ref[0])


def _ref_selection(q, k, t, page_size, budget, attrs):
    """The numpy reference op's ``selected_pages [Hkv, n]`` at decode position ``t`` of one layer
    (``q [1, H, T, D]``, ``k [1, Hkv, T, D]``), its page metadata computed as a pool writes it."""
    from tinyserve_trt.ops import sparse_attention_ref
    from tinyserve_trt.ops.fine_bounds import pages_sub_bounds

    ps, hkv, d = page_size, k.shape[1], k.shape[-1]
    n = -(-t // ps)
    pages = np.zeros((n * ps, hkv, d), np.float32)
    pages[:t] = np.swapaxes(k[0, :, :t], 0, 1)
    cache = np.transpose(pages.reshape(n, ps, hkv, d), (0, 2, 1, 3)).copy()  # [n, Hkv, ps, D]
    kmin = np.stack([np.swapaxes(k[0, :, j * ps:min(t, (j + 1) * ps)], 0, 1).min(0) for j in range(n)])
    kmax = np.stack([np.swapaxes(k[0, :, j * ps:min(t, (j + 1) * ps)], 0, 1).max(0) for j in range(n)])
    sub = None
    if attrs.sub_page_size not in (0, ps):
        valid = np.minimum(ps, t - np.arange(n) * ps)
        sub = pages_sub_bounds(cache, attrs.sub_page_size, kmin, kmax, valid)
    _, ref = sparse_attention_ref(q[:, :, t:t + 1], k[:, :, t:t + 1], k[:, :, t:t + 1], cache, cache, kmin, kmax,
                                  np.arange(n, dtype=np.int32)[None], np.array([t], np.int32),
                                  np.array([budget], np.int32), key_sub_bounds=sub, attrs=attrs)
    return ref[0]


def test_replayed_two_level_selection_is_the_ops():
    """Two-level selection (the export's default) keeps sub-pages, not the coarse top pages: the
    replay must make the op's choice. Failed while calibration ran single-level selection."""
    rng = np.random.default_rng(5)
    ps, T = 16, 200
    q = rng.standard_normal((1, H, T, D)).astype(np.float32)
    k = rng.standard_normal((1, HKV, T, D)).astype(np.float32)
    attrs = schema.OpAttributes(sink_pages=1, recent_pages=1, sub_page_size=4, candidate_share=0.5)
    positions = list(range(60, T, 7))
    sel = replay_selection(q, k, positions, ps, 2 * ps, attrs)
    single = replay_selection(q, k, positions, ps, 2 * ps, schema.OpAttributes(sink_pages=1, recent_pages=1))
    for i, t in enumerate(positions):
        n = -(-t // ps)
        np.testing.assert_array_equal(sel[i, 0, :, :n], _ref_selection(q, k, t, ps, 2 * ps, attrs), err_msg=f"t={t}")
    assert not np.array_equal(sel, single)  # the case tells the two rules apart


def test_replayed_selection_keeps_dense_layers_dense():
    """A package's leading ``dense_layers`` run the dense policy: every page is selected."""
    rng = np.random.default_rng(6)
    T = 40
    q = rng.standard_normal((2, H, T, D)).astype(np.float32)
    k = rng.standard_normal((2, HKV, T, D)).astype(np.float32)
    sel = replay_selection(q, k, [30, 39], PS, PS, schema.OpAttributes(), dense_layers=1)
    assert sel[:, 0, :, :-(-30 // PS)].all() and not sel[:, 1].all()


class ScaledLayerSource(FakeSource):
    """FakeSource whose layer ``loud`` has K and V scaled up 50x: its INT4 cold pages carry 50x the
    absolute quantization error of the others, so it dominates the logits' change."""

    def __init__(self, loud: int):
        super().__init__()
        self.loud = loud

    def _qkv(self, ids):
        q, k, v = super()._qkv(ids)
        k, v = k.copy(), v.copy()
        k[self.loud] *= 50
        v[self.loud] *= 50
        return q, k, v


PROMPTS = ["the quick brown fox jumps over the lazy dog" * 2, "pack my box with five dozen liquor jugs" * 2,
           "sphinx of black quartz, judge my vow" * 2, "how vexingly quick daft zebras jump" * 2]


@pytest.mark.parametrize("loud", [0, 1])
def test_sensitivity_pass_keeps_the_loud_layer_at_int8(loud):
    from tinyserve_trt.calibration.sensitivity import layer_sensitivity, most_sensitive

    src = ScaledLayerSource(loud)
    ids = [src.tokenize(t) for t in PROMPTS]
    cfg = CalibrationConfig(page_size=PS, token_budget=2 * PS, hot_fraction=0.25, cold_format="int4",
                            group_size=4, int8_layers_count=1)
    kl = layer_sensitivity(src, ids[2:], cfg)
    assert len(kl) == L and kl[loud] > 10 * kl[1 - loud] > 0
    assert most_sensitive(kl, 1) == [loud] and most_sensitive(kl, 0) == [] and most_sensitive(kl, 5) == [0, 1]
    art = calibrate(src, ids[:2], ids[2:], cfg, model="fake")
    assert art.int8_layers == [loud] and art.layer_kl == pytest.approx(kl)
    assert art.evaluation["cold_format"] == f"int4 (int8 layers {loud})"
    # keeping the loud layer at INT8 is what makes the package better than all-INT4
    all_int4 = calibrate(src, ids[:2], ids[2:], CalibrationConfig(**{**cfg.__dict__, "int8_layers_count": 0}))
    assert all_int4.int8_layers == [] and all_int4.layer_kl == []
    assert art.evaluation["mean_kl"] < all_int4.evaluation["mean_kl"]
    assert art.evaluation["cold_page_bytes"] > all_int4.evaluation["cold_page_bytes"]


def test_int4_fake_quantize_uses_sub_page_codes_in_two_level_layers():
    """Two-level layers (past dense_layers) quantize INT4 keys on 2-token sub-page bounds: a tighter
    fit than the page bounds the dense layer 0 uses, so the same keys come back closer."""
    rng = np.random.default_rng(0)
    k = np.cumsum(rng.standard_normal((2, 8, D)), axis=1)  # drifting keys: sub-pages span less than pages
    v = rng.standard_normal((2, 8, D))
    cfg = CalibrationConfig(page_size=PS, cold_format="int4", group_size=4, sub_page_size=2, dense_layers=1)
    assert [cfg.keys_on_codes(i) for i in range(2)] == [False, True]
    t = fake_quantize(cfg, [0, 1])
    err = [np.abs(t(layer, k, v)[0] - k).max() for layer in (0, 1)]
    assert 0 < err[1] < err[0]
    np.testing.assert_array_equal(t(0, k, v)[1], t(1, k, v)[1])  # V does not depend on the layer kind


def test_artifact_int8_layers_validation():
    art = _artifact()
    with pytest.raises(ArtifactError, match="out of range for 3 layers"):
        CalibrationArtifact(**{**art.__dict__, "int8_layers": [3]})
    with pytest.raises(ArtifactError, match="layer_kl has 2 entries for 3 layers"):
        CalibrationArtifact(**{**art.__dict__, "layer_kl": [0.1, 0.2]})
    assert CalibrationArtifact(**{**art.__dict__, "int8_layers": [2, 0]}).int8_layers == [0, 2]


def test_replayed_selection_dense_layer_indices():
    """A layer named in dense_layers selects every page, as its exported dense node does."""
    rng = np.random.default_rng(5)
    T, L = 37, 3
    q = rng.standard_normal((L, H, T, D)).astype(np.float32)
    k = rng.standard_normal((L, HKV, T, D)).astype(np.float32)
    sel = replay_selection(q, k, [36], PS, 2 * PS, schema.OpAttributes(), dense_layers=(1,))
    n = -(-36 // PS)
    assert sel[0, 1, :, :n].all() and not sel[0, 0, :, :n].all() and not sel[0, 2, :, :n].all()
