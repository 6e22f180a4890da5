"""tinyserve eval: perplexity and passkey through a package's own runtime (issue #31)."""

from __future__ import annotations

import numpy as np
import pytest

from tinyserve_trt.runtime.eval.passkey import NEEDLE, QUESTION, build_prompt, passkey, random_passkey
from tinyserve_trt.runtime.eval.perplexity import perplexity
from tinyserve_trt.runtime.llm import engine_from
from tinyserve_trt.runtime.model_package import ModelPackage

from ..tiny_models import build_package, original_greedy


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_package("llama", tmp_path_factory.mktemp("eval"))


def _engine(pkg, modes=3):
    return engine_from(ModelPackage.load(pkg), 0, {}, max_batch=modes, prefill_chunk=32, max_tokens_per_step=32,
                       sparse_min_ratio=0.0)


def _source_nll(src, source_io, ids, n):
    """Mean NLL of the last ``n`` tokens of ``ids`` under the ORIGINAL export, one forward pass."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in sess.get_inputs()}
    feeds = {source_io["input_ids"]: np.asarray([ids], np.int64),
             **{p: np.zeros((1, shapes[p][1], 0, shapes[p][3]), np.float32) for p in source_io["past_inputs"]}}
    if source_io.get("attention_mask"):
        feeds[source_io["attention_mask"]] = np.ones((1, len(ids)), np.int64)
    if source_io.get("position_ids"):
        feeds[source_io["position_ids"]] = np.arange(len(ids), dtype=np.int64)[None]
    names = [o.name for o in sess.get_outputs()]
    logits = dict(zip(names, sess.run(None, feeds)))[source_io["logits"]][0].astype(np.float64)
    rows, targets = logits[-n - 1:-1], np.asarray(ids[-n:])
    lse = np.log(np.exp(rows - rows.max(1, keepdims=True)).sum(1)) + rows.max(1)
    return float((lse - rows[np.arange(n), targets]).mean())


def test_dense_perplexity_is_the_source_models(llama):
    """The dense row's NLL = the original export's on the same text; a small budget really selects
    (its NLL differs and the engine counted fewer pages than there are)."""
    src, pkg = llama
    ids = np.random.default_rng(3).integers(3, 250, 160).tolist()
    engine = _engine(pkg)
    rows = perplexity(engine, ids, 48, [8, 160])
    assert [r.budget for r in rows] == [0, 8, 160] and all(r.tokens == 48 for r in rows)
    want = _source_nll(src, engine.package.manifest["source_io"], ids, 48)
    assert rows[0].nll == pytest.approx(want, rel=1e-4, abs=1e-4)
    assert rows[2].nll == pytest.approx(rows[0].nll, rel=1e-5)  # budget >= context: every page
    assert rows[1].nll != pytest.approx(rows[0].nll, rel=1e-6)
    assert 0 < engine.stats()["page_selection_rate"] < 1
    engine.pool.check_integrity()
    assert not engine.pool.in_use_pages()  # every request finished and gave its pages back


def test_passkey_feeds_the_question_then_answers_greedily(llama):
    """The dense answer is the original export's greedy continuation of prompt + question."""
    src, pkg = llama
    package = ModelPackage.load(pkg)
    prompt = build_prompt(package, 300, 0.5, random_passkey(0, 0.5))
    assert len(prompt.prompt_ids) + len(prompt.question_ids) <= 300
    assert NEEDLE.format(key=prompt.passkey) in package.decode(prompt.prompt_ids)
    assert package.decode(prompt.question_ids).startswith(QUESTION)
    rows = passkey(_engine(pkg, 2), prompt, [8])
    assert [r.budget for r in rows] == [0, 8]
    want = original_greedy(src, package.manifest["source_io"], prompt.prompt_ids + prompt.question_ids, 10)
    eos = set(package.eos_token_ids)
    want = want[:next((i for i, t in enumerate(want) if t in eos), len(want))]
    assert rows[0].answer == package.decode(want).strip()
    assert rows[0].correct == (prompt.passkey in "".join(c for c in rows[0].answer if c.isdigit()))


@pytest.mark.parametrize("depth", [0.0, 1.0])
def test_needle_depth(llama, depth):
    package = ModelPackage.load(llama[1])
    text = package.decode(build_prompt(package, 3000, depth, "12345").prompt_ids)
    at = text.index(NEEDLE.format(key="12345")) / len(text)
    assert (at < 0.4) if depth == 0 else (at > 0.8)


@pytest.mark.parametrize("argv,msg", [
    ([], "give --text FILE"),
    (["--passkey", "--context", "999999"], "--context must be in"),
    (["--text", "MISSING"], "No such file"),
    (["--text", "SHORT", "--context", "400"], "shorter than --context 400"),
    (["--passkey", "--budgets", "-1"], "--budgets must be in"),
])
def test_cli_one_line_errors(llama, tmp_path, capsys, argv, msg):
    from tinyserve_trt.runtime import cli

    (tmp_path / "SHORT").write_text("too short")
    argv = [str(tmp_path / a) if a in ("MISSING", "SHORT") else a for a in argv]
    assert cli.main(["eval", str(llama[1]), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0], err


def test_cli_writes_the_tables(llama, tmp_path, capsys):
    from tinyserve_trt.runtime import cli

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "eval.md"
    assert cli.main(["eval", str(llama[1]), "--text", str(text), "--context", "300", "--eval-tokens", "32",
                     "--budgets", "8", "--passkey", "--depths", "0.5", "--seeds", "0", "--out", str(out)]) == 0
    table = out.read_text()
    assert "| dense | " in table and "| 8 | " in table and "Passkey retrieval (1 prompts)" in table


def test_a_forced_eos_does_not_end_the_answer(llama):
    """The question's template tail holds the end-of-turn token (SmolLM2's <|im_end|> is its EOS): fed
    as given, it must not finish the request before the answer. Before, every passkey answer on
    SmolLM2 was '' (0/3 at 8K, dense too)."""
    from tinyserve_trt.runtime.eval.passkey import PasskeyPrompt

    src, pkg = llama
    package = ModelPackage.load(pkg)
    eos = package.eos_token_ids[0]
    prompt = PasskeyPrompt(list(range(10, 60)), [40, eos, 41, 42], "1", 0.5)
    rows = passkey(_engine(pkg, 1), prompt, [])
    want = original_greedy(src, package.manifest["source_io"], prompt.prompt_ids + prompt.question_ids, 10)
    want = want[:next((i for i, t in enumerate(want) if t in set(package.eos_token_ids)), len(want))]
    assert want and rows[0].answer == package.decode(want).strip()
