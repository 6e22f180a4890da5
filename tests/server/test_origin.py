"""A key-less loopback server cannot be driven from a web page (issue #29): POST bodies must
be ``application/json`` (a page's "simple" cross-origin POST is text/plain or a form: 415),
and the Host header must be one this server answers to (DNS rebinding: 421) - loopback
names, the bound host, and ``allowed_hosts``. The Ray ingress applies the same checks."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server.conftest import MODEL, LiveServer, requests_total

BODY = b'{"model": "tiny", "prompt": [5, 6], "max_tokens": 1}'


def _post(url, content_type, host=None):
    headers = {} if content_type is None else {"content-type": content_type}
    if host is not None:
        headers["host"] = host
    return httpx.post(url + "/v1/completions", content=BODY, headers=headers, timeout=30)


@pytest.mark.parametrize("content_type", ["text/plain", None, "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/json; charset=latin-1",
                                          "application/jsonx"])
def test_a_non_json_post_is_415_and_reaches_nothing(server, content_type):
    before = server.metrics()
    r = _post(server.url, content_type)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_media_type" and "\n" not in err["message"]
    after = server.metrics()
    assert after.get("tinyserve_prompt_tokens_total", 0) == before.get("tinyserve_prompt_tokens_total", 0)
    assert requests_total(after, "200") == requests_total(before, "200")


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8"])
def test_json_content_types_are_served(server, content_type):
    assert _post(server.url, content_type).status_code == 200


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8000", "localhost.attacker.example",
                                  "127.0.0.1.nip.io", "evil"])
def test_a_foreign_host_is_421(server, host):
    r = _post(server.url, "application/json", host=host)
    assert r.status_code == 421, r.text
    assert r.json()["error"]["code"] == "misdirected_request"
    assert httpx.get(server.url + "/v1/models", headers={"host": host}).status_code == 421
    assert httpx.get(server.url + "/health", headers={"host": host}).status_code == 200  # probes by pod IP


@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "LOCALHOST:1", "127.0.0.1", "127.0.0.1:9",
                                  "[::1]", "[::1]:8000"])
def test_loopback_hosts_are_served(server, host):
    assert _post(server.url, "application/json", host=host).status_code == 200


def test_allowed_hosts_and_the_bound_host(llama):
    from tinyserve_trt import AsyncLLM
    from tinyserve_trt.runtime.server import ServerConfig
    from tinyserve_trt.runtime.server.hosts import HostAllowList

    live = LiveServer(AsyncLLM(llama[1], max_batch=2),
                      ServerConfig(model_name=MODEL, timeout=60, allowed_hosts=("api.internal", "*.svc.example")))
    try:
        for host in ("api.internal", "api.internal:8000", "a.svc.example", "b.a.svc.example:80"):
            assert _post(live.url, "application/json", host=host).status_code == 200, host
        for host in ("api.internal.evil", "svc.example", "evil.example"):
            assert _post(live.url, "application/json", host=host).status_code == 421, host
    finally:
        live.stop()
    bound = HostAllowList.from_config(ServerConfig(host="10.1.2.3"))
    assert bound.allows("10.1.2.3:8000") and bound.allows("localhost") and not bound.allows("10.1.2.4")
    wildcard = HostAllowList.from_config(ServerConfig(host="0.0.0.0"))
    assert not wildcard.allows("0.0.0.0") and not wildcard.allows("myhost")
    assert HostAllowList.from_config(ServerConfig(host="0.0.0.0", allowed_hosts=("*",))).allows("anything")
    for bad in ("", "a b", "http://x", "x/y", "a*b"):
        with pytest.raises(ValueError, match="allowed_hosts"):
            ServerConfig(allowed_hosts=(bad,))


def test_allowed_host_flag_is_repeatable():
    from tinyserve_trt.runtime.cli import _server_config, build_parser

    args = build_parser().parse_args(["serve", "/pkg", "--allowed-host", "api.internal", "--allowed-host", "*.svc"])
    assert _server_config(args).allowed_hosts == ("api.internal", "*.svc")
    assert _server_config(build_parser().parse_args(["serve", "/pkg"])).allowed_hosts == ()


class _FakeEngine:
    """The DeploymentHandle the ingress forwards to; records the calls that reached it."""

    def __init__(self):
        self.calls = []

    def options(self, **kw):
        return self

    @property
    def http(self):
        return self

    def remote(self, *args, **kw):
        self.calls.append(args)
        items = iter([{"status": 200, "headers": [(b"content-type", b"application/json")]}, b"{}"])

        class Stream:
            def __aiter__(self):
                return self

            async def __anext__(self):
                try:
                    return next(items)
                except StopIteration:
                    raise StopAsyncIteration from None

            def cancel(self):
                pass

        return Stream()


def _ingress_call(ingress, method, path, headers, body=b""):
    from starlette.requests import Request

    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()], "scheme": "http",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1), "root_path": "", "http_version": "1.1"}
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    async def go():
        return await ingress(Request(scope, receive))

    return asyncio.run(go())


def test_the_ray_ingress_checks_content_type_and_host(llama):
    pytest.importorskip("ray.serve")
    from tinyserve_trt.runtime.server import ServerConfig
    from tinyserve_trt.runtime.server.ray_ingress import Ingress

    engine = _FakeEngine()
    ingress = Ingress(engine, str(llama[1]), ServerConfig(model_name=MODEL), 4, "engine")
    r = _ingress_call(ingress, "POST", "/v1/completions", {"host": "127.0.0.1:8000", "content-type": "text/plain"},
                      BODY)
    assert r.status_code == 415
    r = _ingress_call(ingress, "POST", "/v1/completions",
                      {"host": "attacker.example", "content-type": "application/json"}, BODY)
    assert r.status_code == 421
    assert engine.calls == []  # neither reached a replica
    r = _ingress_call(ingress, "POST", "/v1/completions",
                      {"host": "localhost:8000", "content-type": "application/json"}, BODY)
    assert r.status_code == 200 and len(engine.calls) == 1
