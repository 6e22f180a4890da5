"""GenaiGraphTimer (tinyserve_dev/peers/genai_graph.py) runs ORT GenAI's own graph as its generator
does: on a tiny Qwen2 built by GenAI's model builder, its greedy tokens at batch 2 - the shared
prefix prefilled at batch 1 in pieces and copied to each row - equal GenAI's own generator's (which
takes the batch's prompt in one piece)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai (the dev extra) is not installed")

from tests.tiny_models import VOCAB, write_byte_tokenizer  # noqa: E402
from tinyserve_dev.peers.genai_graph import GenaiGraphTimer  # noqa: E402


@pytest.fixture(scope="module")
def genai_model(tmp_path_factory):
    from tinyserve_dev.models.tiny_models import TinyModelConfig, build_tiny_model

    root = tmp_path_factory.mktemp("genai")
    model = build_tiny_model(TinyModelConfig(kind="qwen2", vocab_size=VOCAB, max_positions=512, seed=0))
    model.save_pretrained(str(root / "hf"))
    write_byte_tokenizer(root / "hf")
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(root / "hf"), "-o",
                    str(root / "genai"), "-p", "fp32", "-e", "cpu"], check=True, capture_output=True)
    config = json.loads((root / "genai" / "genai_config.json").read_text())
    config["model"].update(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # the byte tokenizer's 256 is past VOCAB
    (root / "genai" / "genai_config.json").write_text(json.dumps(config))
    return root / "genai"


def test_graph_timer_decodes_what_genai_decodes(genai_model):
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, VOCAB, 150).tolist()
    rows = [prefix + [7], prefix + [11]]
    timer = GenaiGraphTimer(genai_model, rows, max_new=8, threads=1, chunk=64)  # 3 pieces of the prefix
    B, n = timer.rows.shape
    got = [timer._run(timer.rows[:, -1:], n - 1, slice(0, B)).argmax(-1)]
    for step in range(4):
        got.append(timer._run(got[-1][:, None], n + step, slice(0, B)).argmax(-1))
    model = og.Model(og.Config(str(genai_model)))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=n + 10, batch_size=B, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(rows, np.int32))
    want = []
    for _ in range(5):
        gen.generate_next_token()
        want.append(gen.get_next_tokens())
    assert np.stack(got, 1).tolist() == np.stack(want, 1).tolist()
    assert timer.time(3) > 0  # a timed pass from the prompt again
