"""The OpenAI API over the real server, driven by the official ``openai`` client:
completions, chat, streaming, stop strings, n > 1, logprobs, usage, models, health."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_completion_text_usage_and_determinism(client):
    a = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, **GREEDY)
    b = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, **GREEDY)
    assert a.object == "text_completion" and a.id.startswith("cmpl-") and a.model == MODEL
    (choice,) = a.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text == b.choices[0].text
    assert a.usage.completion_tokens == 8 and a.usage.prompt_tokens >= 5
    assert a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens


def test_completion_token_id_prompts_and_prompt_lists(client):
    r = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [9, 9, 9, 9]], max_tokens=3, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 6
    single = client.completions.create(model=MODEL, prompt=[9, 9, 9, 9], max_tokens=3, **GREEDY)
    assert single.choices[0].text == r.choices[1].text


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model=MODEL, prompt="Hello", max_tokens=24, **GREEDY).choices[0].text
    stop = full[5:7]
    assert stop and stop not in full[:5 + len(stop) - 1]
    cut = client.completions.create(model=MODEL, prompt="Hello", max_tokens=24, stop=[stop], **GREEDY)
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 24


def test_streaming_completion_matches_the_whole_answer(client):
    whole = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=16, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert all(c.id == chunks[0].id and c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_sse_wire_format(server):
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 4, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_chat_and_chat_stream(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, **GREEDY)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    # the package's template: "<system>be brief\n<user>hi\n<assistant>" = 32 byte-level tokens
    assert r.usage.prompt_tokens == len("<system>be brief\n<user>hi\n<assistant>")
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_samples_seeded(client):
    kw = dict(model=MODEL, prompt="abc", max_tokens=6, n=3, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2] and a.usage.completion_tokens == 18
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seed: reproducible per sample
    assert len({c.text for c in a.choices}) > 1
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=4, n=2, stream=True, seed=1,
                                                 extra_body={"ignore_eos": True}))
    done = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert done == {0, 1}


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    # greedy: the chosen token is the most likely one
    assert all(max(top.values()) == pytest.approx(chosen, abs=1e-5) and 1 <= len(top) <= 3
               for chosen, top in zip(lp.token_logprobs, lp.top_logprobs))
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       logprobs=True, top_logprobs=2, **GREEDY)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_token_budget_extension_and_metrics(server, client):
    before = server.metrics()
    dense = client.completions.create(model=MODEL, prompt=list(range(3, 80)), max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True, "token_budget": 0})
    assert dense.usage.completion_tokens == 8
    m = server.wait_idle()
    assert m['tinyserve_kv_pages{state="used"}'] == 0
    assert m["tinyserve_generation_tokens_total"] - before["tinyserve_generation_tokens_total"] == 8
    assert m["tinyserve_time_to_first_token_seconds_count"] > before["tinyserve_time_to_first_token_seconds_count"]
    assert 0 < m["tinyserve_selected_page_rate"] <= 1 and m["tinyserve_token_budget"] == 16
