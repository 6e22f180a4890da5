"""Passkey prompts with a tiny word-level tokenizer, and a trial through a tiny random LLaMA."""

import random
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tinyserve_dev.evaluation import passkey as pk  # noqa: E402
from tinyserve_dev.evaluation.decode_attention import DENSE, SelectionSpec  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    words = set(re.findall(r"\w+|[^\w\s]", pk.INSTRUCTION + pk.FILLER + pk.NEEDLE + pk.QUESTION + "user assistant"))
    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for w in sorted(words):
        vocab.setdefault(w, len(vocab))
    model = tokenizers.models.WordLevel(vocab=vocab, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([tokenizers.pre_tokenizers.Whitespace(),
                                                           tokenizers.pre_tokenizers.Digits(individual_digits=True)])
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"] + [str(d) for d in range(10)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="[UNK]")
    fast.chat_template = TEMPLATE
    return fast


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompt_length_depth_and_split(tokenizer, depth):
    prompt = pk.build_prompt(tokenizer, 400, depth, "12345")
    assert 400 - 30 <= prompt.length <= 400
    prefill = tokenizer.decode(prompt.prefill_ids)
    assert "1 2 3 4 5" in prefill or "12345" in prefill
    assert "pass key ?" in tokenizer.decode(prompt.decode_ids) or "pass key?" in tokenizer.decode(prompt.decode_ids)
    where = prefill.index("Remember") / len(prefill)
    assert abs(where - depth) < 0.15
    with pytest.raises(ValueError):
        pk.build_prompt(tokenizer, 400, 1.5, "12345")


def test_trial_answers_under_each_selection(tokenizer):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=1024)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = pk.build_prompt(tokenizer, 300, 0.3, pk.random_passkey(random.Random(0)))
    trial = pk.PasskeyTrial(model, tokenizer, prompt, max_new_tokens=3)
    dense = trial.answer(DENSE)
    assert trial.answer(DENSE) == dense  # each answer restarts from the prefill cache
    ok, text = trial.correct(SelectionSpec("query_aware", budget=64, page_size=16), dense_layers=1)
    assert isinstance(ok, bool) and isinstance(text, str)
