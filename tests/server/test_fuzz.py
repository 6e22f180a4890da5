"""Fuzzing the HTTP API with Schemathesis (issue #19): requests generated from the server's own
OpenAPI schema - bodies that fit it and bodies that break it - against a live server over
the tiny package. No answer may be a 5xx; afterwards the server is healthy and holds no page.

Bounded for CI: ``FUZZ_REQUESTS`` requests over every operation, and a server whose limits
(context 64 tokens, n <= 4, 8 prompts) keep each request to a few hundred decode steps.
The count of requests and server errors goes to the terminal summary (``conftest.py``).
"""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL, FUZZ_REPORT, LiveServer

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

FUZZ_REQUESTS = 300


@pytest.fixture(scope="module")
def fuzz_server(llama):
    from tinyserve_trt import AsyncLLM
    from tinyserve_trt.runtime.server import ServerConfig

    llm = AsyncLLM(llama[1], max_batch=16, max_seq_len=64)
    live = LiveServer(llm, ServerConfig(model_name=MODEL, timeout=30, max_n=4, max_prompts=8))
    yield live
    live.stop()


def test_schema_declares_the_request_bodies(fuzz_server):
    schema = httpx.get(fuzz_server.url + "/openapi.json").json()
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        fields = schema["components"]["schemas"][model]["properties"]
        assert {"model", "n", "temperature", "max_tokens", "token_budget"} <= set(fields)
        assert fields["n"]["maximum"] == 128
    assert {"/health", "/metrics", "/v1/models"} <= set(schema["paths"])


def test_fuzzed_requests_never_get_a_server_error(fuzz_server):
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    seen = {"requests": 0, "server_errors": 0, "by_status": {}, "failures": []}

    @settings(max_examples=FUZZ_REQUESTS, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=cases, keep_model=st.booleans())
    def one(case, keep_model):
        # most bodies name the served model, so they get past the model check into the engine
        if isinstance(case.body, dict) and not keep_model:
            case.body["model"] = MODEL
        response = case.call(base_url=fuzz_server.url, timeout=60)
        seen["requests"] += 1
        seen["by_status"][response.status_code] = seen["by_status"].get(response.status_code, 0) + 1
        if response.status_code >= 500:
            seen["server_errors"] += 1
            seen["failures"].append((case.method, case.path, case.body, response.status_code, response.text[:300]))

    one()
    FUZZ_REPORT.append(f"schemathesis: {seen['requests']} requests, {seen['server_errors']} server errors "
                       f"(statuses {dict(sorted(seen['by_status'].items()))})")
    assert seen["server_errors"] == 0, seen["failures"][:5]
    assert seen["requests"] >= FUZZ_REQUESTS // 2
    assert seen["by_status"].get(200, 0) > 0  # some requests reached the engine and were answered
    assert httpx.get(fuzz_server.url + "/health").status_code == 200
    m = fuzz_server.wait_idle(timeout=60)
    assert m["tinyserve_requests_in_flight"] == 0 and m["tinyserve_engine_step_failures_total"] == 0
    assert fuzz_server.check_integrity()["pages_in_use"] == 0
