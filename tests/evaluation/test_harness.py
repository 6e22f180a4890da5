"""The harness inside a tiny random LLaMA (GQA): dense parity, prefill/decode split, perplexity."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tinyserve_dev.evaluation.decode_attention import DENSE, SelectionSpec  # noqa: E402
from tinyserve_dev.evaluation.hf_harness import SparseAttentionHarness, use_harness  # noqa: E402
from tinyserve_dev.evaluation.perplexity import PrefixPerplexity, cache_kwarg  # noqa: E402
from tinyserve_dev.evaluation.recall import RecallProbe  # noqa: E402

T = 96


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 101, (T,), generator=torch.Generator().manual_seed(1))
    return model, ids


def logits(model, ids, harness=None, **kw):
    with torch.no_grad():
        if harness is None:
            return model(input_ids=ids[None], **kw).logits[0]
        with use_harness(model, harness):
            return model(input_ids=ids[None], **kw).logits[0]


def test_dense_harness_matches_model(tiny):
    model, ids = tiny
    want = logits(model, ids)
    for decode_from in (0, 40):
        got = logits(model, ids, SparseAttentionHarness(DENSE, decode_from=decode_from, chunk=16))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert model.config._attn_implementation == "sdpa" or "tinyserve" not in model.config._attn_implementation


def test_decode_rows_through_cache_equal_one_pass(tiny):
    """Prefill then decode through the KV cache = one call whose late rows are decode steps."""
    model, ids = tiny
    spec = SelectionSpec("query_aware", budget=16, page_size=8)
    harness = SparseAttentionHarness(spec, dense_layers=1, decode_from=50, chunk=16)
    one_pass = logits(model, ids, harness)
    with torch.no_grad():
        with use_harness(model, harness):
            out = model(input_ids=ids[None, :50], use_cache=True)
            cache = getattr(out, "past_key_values", None) or out.cache
            tail = model(input_ids=ids[None, 50:], use_cache=True, **{cache_kwarg(model): cache}).logits[0]
    torch.testing.assert_close(tail, one_pass[50:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one_pass[:50], logits(model, ids)[:50], atol=1e-5, rtol=1e-5)
    assert (one_pass[70:] - logits(model, ids)[70:]).abs().max() > 1e-4  # the budget bites


def test_dense_layers_are_dense(tiny):
    model, ids = tiny
    spec = SelectionSpec("window", budget=8, page_size=8, sink_pages=0)
    all_dense = logits(model, ids, SparseAttentionHarness(spec, dense_layers=3, decode_from=10))
    torch.testing.assert_close(all_dense, logits(model, ids), atol=1e-5, rtol=1e-5)


def test_perplexity_runs_are_independent(tiny):
    model, ids = tiny
    pp = PrefixPerplexity(model, ids, eval_from=40, chunk=16)
    dense = pp.run(DENSE)
    sparse = pp.run(SelectionSpec("window", budget=8, page_size=8))
    again = pp.run(DENSE)
    assert dense.tokens == T - 41 == pp.eval_tokens
    assert dense.nll == pytest.approx(again.nll, abs=1e-6)
    assert sparse.nll != pytest.approx(dense.nll, abs=1e-4)
    with torch.no_grad():
        full = torch.nn.functional.cross_entropy(model(input_ids=ids[None]).logits[0, 40:-1], ids[41:])
    assert dense.nll == pytest.approx(float(full), abs=1e-5)


def test_probe_sees_every_layer(tiny):
    model, ids = tiny
    specs = [SelectionSpec(p, page_size=8, page_fraction=0.3) for p in ("query_aware", "oracle")]
    probe = RecallProbe(specs)
    PrefixPerplexity(model, ids, eval_from=40, chunk=16).run(DENSE, probe=probe)
    assert probe.layers() == [0, 1, 2]
    qa, oracle = (probe.mean(s.label()) for s in specs)
    # (oracle is no strict bound: with group_reduce=max it maximises the best head's mass, not the mean)
    assert 0.1 < qa <= 1 + 1e-9 and 0.1 < oracle <= 1 + 1e-9
    assert probe.mean(specs[0].label(), dense_layers=3) == pytest.approx(1.0)


def test_light_import():
    import subprocess
    import sys
    code = ("import sys, tinyserve_dev.evaluation, tinyserve_dev.evaluation.results, "
            "tinyserve_dev.evaluation.texts; assert 'torch' not in sys.modules; print('ok')")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"


def test_dense_layer_indices_are_dense(tiny):
    """Naming every layer by index is all dense; naming some is neither all dense nor the count form."""
    model, ids = tiny
    spec = SelectionSpec("window", budget=8, page_size=8, sink_pages=0)
    n = model.config.num_hidden_layers
    every = logits(model, ids, SparseAttentionHarness(spec, dense_layers=tuple(range(n)), decode_from=10))
    torch.testing.assert_close(every, logits(model, ids), atol=1e-5, rtol=1e-5)
    last = logits(model, ids, SparseAttentionHarness(spec, dense_layers=(n - 1,), decode_from=10))
    first = logits(model, ids, SparseAttentionHarness(spec, dense_layers=1, decode_from=10))
    assert (last - first).abs().max() > 1e-4 and (last - every).abs().max() > 1e-4
