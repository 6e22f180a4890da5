"""--warmup: the prompts of the file are prefilled at start, so the first request of each warmed
prefix reuses its pages (engine counters); a bad file is one line and exit 2."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.server.conftest import MODEL, LiveServer
from tinyserve_trt.runtime.server.warmup import load_warmup, warmup_token_ids

SYSTEM = "You are a careful assistant for a hardware shop; answer briefly and name the aisle. " * 3
PLAIN = "The quick brown fox jumps over the lazy dog while the farmer counts his sheep. " * 3
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where are the nails?"}]


@pytest.fixture(scope="module")
def warmed(llama, tmp_path_factory):
    from tinyserve_trt import AsyncLLM
    from tinyserve_trt.runtime.server import ServerConfig

    path = tmp_path_factory.mktemp("warmup") / "prompts.jsonl"
    path.write_text("\n".join([PLAIN, "", json.dumps({"prompt": SYSTEM}), json.dumps({"messages": CHAT})]) + "\n")
    items = load_warmup(path)
    assert items == ({"prompt": PLAIN.strip()}, {"prompt": SYSTEM}, {"messages": CHAT})
    llm = AsyncLLM(llama[1], max_batch=4)
    ids = warmup_token_ids(llm.package, items)
    live = LiveServer(llm, ServerConfig(model_name=MODEL, timeout=60), warmup=ids)
    yield live, ids
    live.stop()


def _counters(live) -> dict:
    return asyncio.run(live.llm.run_on_engine(lambda e: dict(e.counters, page_size=e.pool.page_size)))


def test_first_request_of_each_warmed_prefix_hits_the_cache(warmed):
    live, ids = warmed
    c0 = _counters(live)
    assert c0["prefix_tokens_reused"] == 0 and c0["prompt_tokens"] == sum(map(len, ids))  # only the warm-up ran
    ps = c0["page_size"]
    client = live.client(timeout=60)
    requests = [lambda: client.completions.create(model=MODEL, prompt=PLAIN.strip(), max_tokens=2),
                lambda: client.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=2),
                lambda: client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)]
    for send, warm in zip(requests, ids):
        before = _counters(live)["prefix_tokens_reused"]
        send()
        reused = _counters(live)["prefix_tokens_reused"] - before
        assert reused >= (len(warm) // ps - 1) * ps and reused > 0, (reused, len(warm))
    before = _counters(live)["prefix_tokens_reused"]  # control: a prompt that was not warmed reuses nothing
    client.completions.create(model=MODEL, prompt="Entirely different words about rivers and boats " * 3,
                              max_tokens=2)
    assert _counters(live)["prefix_tokens_reused"] == before
    m = live.metrics()
    assert m["tinyserve_prefix_cache_hit_rate"] > 0


@pytest.mark.parametrize("content, message", [
    ("", "no prompts"), ("\n  \n", "no prompts"), ('{"prompt": ', "line 1: not valid JSON"),
    ('ok\n{"text": "x"}', "line 2: expected an object with exactly one of"),
    ('{"prompt": "a", "messages": []}', "exactly one of"), ('{"prompt": ""}', "non-empty string"),
    ('{"messages": [{"role": "user"}]}', "'messages' must be"), ('{"prompt": 3}', "line 1: 'prompt' must"),
])
def test_bad_file_is_one_line_value_error(tmp_path, content, message):
    path = tmp_path / "w.txt"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as e:
        load_warmup(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_cli_bad_warmup_exits_2_before_loading(llama, tmp_path, capsys):
    from tinyserve_trt.runtime.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": "hi"}\n')
    for path in (bad, tmp_path / "missing.txt"):
        assert main(["serve", str(llama[1]), "--warmup", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "warmup file" in err
