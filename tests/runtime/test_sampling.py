import numpy as np
import pytest

from tinyserve_trt.runtime.sampling import Sampler, SamplingParams
from tinyserve_trt.runtime.sequence import Sequence


def seqs_for(*params, history=(0,)):
    return [Sequence(f"r{i}", list(history), p) for i, p in enumerate(params)]


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -1}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 0}, "top_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"), ({"logprobs": -1}, "logprobs"),
    ({"token_budget": -5}, "token_budget"),
])
def test_params_reject(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_lists_become_tuples():
    p = SamplingParams(stop=["x"], stop_token_ids=[3])
    assert p.stop == ("x",) and p.stop_token_ids == (3,)
    hash(p)


def test_greedy_and_degenerate_filters_pick_argmax():
    logits = np.random.default_rng(0).standard_normal((3, 50))
    seqs = seqs_for(SamplingParams(temperature=0), SamplingParams(top_k=1, seed=1),
                    SamplingParams(top_p=1e-9, seed=2))
    out = Sampler()(logits, seqs)
    np.testing.assert_array_equal(out.token_ids, logits.argmax(axis=1))
    assert out.logprobs is None


def test_greedy_float32_rows_pick_the_first_max_and_nan_like_float64():
    """Greedy rows take the argmax of the float32 row itself (no float64 copy): the first of tied
    maxima and the first NaN, as over the float64 row; a greedy row with a repetition penalty or
    logprobs still goes the float64 way."""
    logits = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    logits[0, [5, 9]] = 7.0
    logits[1, [4, 20]] = np.nan
    logits[2, 11] = np.float32(np.inf)
    seqs = seqs_for(*[SamplingParams(temperature=0)] * 3, SamplingParams(temperature=0, repetition_penalty=2.0),
                    history=(1,))
    out = Sampler()(logits, seqs)
    assert list(out.token_ids[:3]) == [5, 4, 11]
    assert out.token_ids[3] == int(np.argmax(np.where(logits[3] > 0, logits[3] / 2, logits[3] * 2)
                                             * (np.arange(64) == 1) + logits[3] * (np.arange(64) != 1)))


def test_seeded_rows_reproduce_whatever_the_batch():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((1, 100))
    a = [Sampler()(logits, seqs_for(SamplingParams(seed=7))).token_ids[0] for _ in range(1)]
    draws = []
    for _ in range(2):
        seq = seqs_for(SamplingParams(seed=7))[0]
        other = seqs_for(SamplingParams())[0]
        draws.append([int(Sampler()(np.vstack([logits, logits]), [other, seq]).token_ids[1])
                      for _ in range(20)])
    assert draws[0] == draws[1] and draws[0][0] == a[0]


def test_top_k_top_p_restrict_support():
    logits = np.log(np.array([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    seq_k = seqs_for(SamplingParams(top_k=2, seed=0))
    seq_p = seqs_for(SamplingParams(top_p=0.85, seed=0))
    s = Sampler()
    got_k = {int(s(logits, seq_k).token_ids[0]) for _ in range(300)}
    got_p = {int(s(logits, seq_p).token_ids[0]) for _ in range(300)}
    assert got_k == {0, 1} and got_p == {0, 1, 2}


def test_sampling_follows_softmax():
    probs = np.array([0.6, 0.3, 0.1])
    seq = seqs_for(SamplingParams(seed=3))
    s = Sampler()
    draws = np.array([s(np.log(probs)[None], seq).token_ids[0] for _ in range(4000)])
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / 4000, probs, atol=0.03)


def test_temperature_sharpens():
    logits = np.log(np.array([[0.6, 0.4]]))
    seq = seqs_for(SamplingParams(temperature=0.1, seed=4))
    assert np.mean([Sampler()(logits, seq).token_ids[0] == 0 for _ in range(500)]) > 0.95


def test_repetition_penalty_moves_argmax():
    logits = np.array([[2.0, 1.9, -1.0]])
    seq = seqs_for(SamplingParams(temperature=0, repetition_penalty=2.0), history=[0, 0])
    assert Sampler()(logits, seq).token_ids[0] == 1
    seq = seqs_for(SamplingParams(temperature=0, repetition_penalty=1.0), history=[0])
    assert Sampler()(logits, seq).token_ids[0] == 0


def test_logprobs_and_inactive_rows():
    logits = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 5.0]])
    seqs = seqs_for(SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0))
    out = Sampler()(logits, seqs, active=np.array([True, False]))
    assert out.token_ids.tolist() == [2, -1]
    lp = logits[0] - np.log(np.exp(logits[0]).sum())
    assert out.logprobs[0] == pytest.approx(lp[2], rel=1e-6) and np.isnan(out.logprobs[1])
    assert [t for t, _ in out.top_logprobs[0]] == [2, 1] and out.top_logprobs[1] is None
    with pytest.raises(ValueError, match="logits"):
        Sampler()(logits[:1], seqs)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": float("inf")}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"token_budget": 10**12}, "token_budget"), ({"max_tokens": 2**31}, "max_tokens"),
    ({"top_k": 2**40}, "top_k"), ({"n": 129}, "n"), ({"n": 100000}, "n"), ({"seed": 2**64}, "seed"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids"), ({"stop": ["x"] * 17}, "stop"),
    ({"stop": ["x" * 2000]}, "stop"), ({"logprobs": 2**31}, "logprobs"), ({"temperature": True}, "temperature"),
])
def test_params_reject_out_of_bounds(kwargs, field):
    """Bounds that need no package: finite floats, int32-safe ints, n <= 128 (issue #19)."""
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_params_accept_the_bounds():
    SamplingParams(n=128, max_tokens=2**31 - 1, token_budget=2**31 - 1, seed=2**64 - 1, stop=["x"] * 16,
                   temperature=1e300, top_k=2**31 - 1)


def test_extreme_but_valid_params_sample_a_real_token():
    """Near-zero temperatures and huge penalties overflow the logits; the sampler still
    returns a token of the vocabulary (greedy), never NaN-driven garbage."""
    logits = np.random.default_rng(3).standard_normal((3, 40))
    seqs = seqs_for(SamplingParams(temperature=1e-300, seed=0), SamplingParams(repetition_penalty=1e-300, seed=0),
                    SamplingParams(temperature=1e300, seed=0), history=(int(logits[1].argmax()),))
    out = Sampler()(logits, seqs).token_ids
    assert out[0] == logits[0].argmax() and 0 <= out[1] < 40 and 0 <= out[2] < 40
