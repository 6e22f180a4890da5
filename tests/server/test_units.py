"""Server pieces without HTTP: config validation, admission, the metrics text format."""

from __future__ import annotations

import pytest

from tinyserve_trt.runtime.server.admission import Admission
from tinyserve_trt.runtime.server.config import ServerConfig
from tinyserve_trt.runtime.server.errors import APIError
from tinyserve_trt.runtime.server.metrics import Histogram, ServerMetrics, parse_metrics


@pytest.mark.parametrize("kw, match", [(dict(port=70000), "port"), (dict(max_queue=-1), "max_queue"),
                                       (dict(timeout=0), "timeout"), (dict(model_name=""), "model_name"),
                                       (dict(host=""), "host"), (dict(body_timeout_s=0), "body_timeout_s"),
                                       (dict(render_timeout_s=float("inf")), "render_timeout_s"),
                                       (dict(render_workers=0), "render_workers"),
                                       (dict(render_memory_bytes=0), "render_memory_bytes"),
                                       (dict(allowed_hosts=["x"]), "allowed_hosts")])
def test_server_config_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        ServerConfig(**kw)


def test_admission_bounds_and_pairs():
    a = Admission(2)
    a.acquire(), a.acquire()
    with pytest.raises(APIError) as e:
        a.acquire()
    assert e.value.status == 429 and e.value.body()["error"]["type"] == "rate_limit_error"
    a.release(), a.release()
    with pytest.raises(RuntimeError):
        a.release()


def test_histogram_is_cumulative_and_parses_back():
    h = Histogram("x_seconds", "x", (0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 3.0):
        h.observe(v)
    m = parse_metrics("\n".join(h.render()))
    assert [m['x_seconds_bucket{le="0.1"}'], m['x_seconds_bucket{le="1"}'], m['x_seconds_bucket{le="+Inf"}']] == \
        [1, 3, 4]
    assert m["x_seconds_count"] == 4 and m["x_seconds_sum"] == pytest.approx(4.05)


def test_metrics_render_has_every_family():
    engine = dict(pages_free=5, pages_in_use=2, pages_cached_idle=1, pages_total=8, prefix_hit_rate=0.5,
                  page_selection_rate=None, token_budget=16, preemptions=0)
    text = ServerMetrics().render(engine, waiting=1, running=2, in_flight=3)
    m = parse_metrics(text)
    assert m['tinyserve_kv_pages{state="used"}'] == 2 and m["tinyserve_queue_depth"] == 1
    assert m["tinyserve_requests_in_flight"] == 3 and str(m["tinyserve_selected_page_rate"]) == "nan"
    assert all(line.startswith(("# HELP", "# TYPE", "tinyserve_")) for line in text.splitlines())


def test_metrics_have_the_kv_store_families():
    engine = dict(pages_free=5, pages_in_use=2, pages_cached_idle=1, pages_total=8, prefix_hit_rate=0.5,
                  page_selection_rate=None, token_budget=16, preemptions=0, prefix_pages_pool=3,
                  prefix_pages_host=4, prefix_pages_disk=5, kv_store_disk_hit_bytes=1000, kv_store_host_put_bytes=70,
                  kv_store_disk_bytes=4096,
                  ttft_by_prefix_source={"disk": dict(requests=2, sum_s=0.5, p50_ms=250.0, mean_ms=250.0)})
    m = parse_metrics(ServerMetrics().render(engine, waiting=0, running=0, in_flight=0))
    assert [m[f'tinyserve_prefix_pages_reused_total{{tier="{t}"}}'] for t in ("pool", "host", "disk")] == [3, 4, 5]
    assert m['tinyserve_kv_store_bytes_total{tier="disk",direction="read"}'] == 1000
    assert m['tinyserve_kv_store_bytes_total{tier="host",direction="written"}'] == 70
    assert m['tinyserve_kv_store_bytes{tier="disk"}'] == 4096
    assert m['tinyserve_ttft_by_prefix_source_seconds_sum{source="disk"}'] == 0.5
    assert m['tinyserve_ttft_by_prefix_source_seconds_count{source="disk"}'] == 2
    # an engine without a store renders zeros, not a KeyError
    plain = dict(engine)
    for k in [k for k in plain if k.startswith(("prefix_pages", "kv_store", "ttft_by"))]:
        del plain[k]
    assert parse_metrics(ServerMetrics().render(plain, 0, 0, 0))['tinyserve_prefix_pages_reused_total{tier="disk"}'] == 0
