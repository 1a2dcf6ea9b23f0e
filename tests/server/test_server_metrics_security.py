"""/metrics parses as Prometheus text and counts what happened; the safety rules hold."""

import socket

import httpx
import pytest
from server_helpers import SchedulingFakeClient, metric, parse_prometheus, running_server

from exlcli.client.runtime_file import is_loopback_host
from exlcli.engine.stats import STEP_TIME_BUCKETS, EngineStats
from exlcli.errors import ExlcliError
from exlcli.server.app import ServerConfig
from exlcli.server.metrics import render_metrics
from exlcli.server.security import check_bind_allowed, key_matches
from exlcli.server.tracker import RequestTracker


def test_metrics_parse_and_count_the_traffic():
    client = SchedulingFakeClient(max_running=2, token_delay=0.001)
    with running_server(client) as live:
        for i in range(3):
            httpx.post(live.url + "/v1/completions", json={"prompt": f"a b {i}", "client": "batch"})
        httpx.post(live.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})
        httpx.post(live.url + "/v1/completions", json={"prompt": "a", "temperature": -1})
        response = httpx.get(live.url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    types, samples = parse_prometheus(response.text)
    assert types["exlcli_time_to_first_token_seconds"] == "histogram"
    assert types["exlcli_kv_pages_free"] == "gauge"
    assert types["exlcli_generation_tokens"] == "counter"
    assert metric(samples, "exlcli_generation_tokens_total") == 3 * 4 + 1
    assert metric(samples, "exlcli_time_to_first_token_seconds_count") == 4
    assert metric(samples, "exlcli_request_latency_seconds_count") == 4
    assert metric(samples, "exlcli_server_generations_finished_total", reason="stop") == 3
    assert metric(samples, "exlcli_server_generations_finished_total", reason="length") == 1
    assert metric(samples, "exlcli_http_responses_total", endpoint="/v1/completions", status="200") == 4
    assert metric(samples, "exlcli_http_responses_total", endpoint="/v1/completions", status="400") == 1
    assert metric(samples, "exlcli_kv_pages_used") == 0
    assert metric(samples, "exlcli_requests_running") == 0
    for family, kind in types.items():  # every histogram: cumulative buckets ending at +Inf == count
        if kind != "histogram":
            continue
        buckets = [(labels["le"], v) for n, labels, v in samples if n == family + "_bucket"]
        assert buckets[-1][0] == "+Inf"
        values = [v for _, v in buckets]
        assert values == sorted(values)
        assert values[-1] == metric(samples, family + "_count")


def test_step_time_histogram_comes_from_engine_stats():
    stats = EngineStats(pages_total=10, pages_used=3, pages_cached=2, num_steps=5, step_time_sum_s=0.5,
                        step_time_bucket_counts=[1, 0, 0, 2, 0, 0, 0, 0, 0, 0, 2])
    _, samples = parse_prometheus(render_metrics(stats, RequestTracker(), num_waiting=0))
    assert metric(samples, "exlcli_step_time_seconds_bucket", le=str(STEP_TIME_BUCKETS[0])) == 1
    assert metric(samples, "exlcli_step_time_seconds_bucket", le=str(STEP_TIME_BUCKETS[3])) == 3
    assert metric(samples, "exlcli_step_time_seconds_bucket", le="+Inf") == 5
    assert metric(samples, "exlcli_step_time_seconds_sum") == 0.5
    assert metric(samples, "exlcli_kv_pages_free") == 5


def test_loopback_rules():
    assert all(is_loopback_host(h) for h in ("127.0.0.1", "127.5.0.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback_host(h) for h in ("0.0.0.0", "::", "192.168.1.4", "example.com"))
    check_bind_allowed("127.0.0.1", None)
    check_bind_allowed("0.0.0.0", "key")
    with pytest.raises(ExlcliError, match="refusing to listen on 0.0.0.0 without an API key"):
        check_bind_allowed("0.0.0.0", None)


def test_key_comparison():
    assert key_matches("abc", "abc")
    assert not key_matches("abd", "abc")
    assert not key_matches(None, "abc")
    assert not key_matches("ab", "abc")
    assert not key_matches("\udcff", "abc")  # undecodable input does not crash the compare


def test_body_size_limit_by_length_and_while_streaming():
    from exlcli.client.fake import FakeClient

    with running_server(FakeClient(), ServerConfig(max_body_bytes=1000)) as live:
        ok = httpx.post(live.url + "/v1/completions", json={"prompt": "x " * 100})
        assert ok.status_code == 200
        big = httpx.post(live.url + "/v1/completions", json={"prompt": "x " * 1000})
        assert big.status_code == 413
        assert big.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(50):
                yield b"y " * 20
            yield b'"}'

        chunked = httpx.post(live.url + "/v1/completions", content=chunks(),
                             headers={"content-type": "application/json"})
        assert chunked.status_code == 413
        assert httpx.get(live.url + "/health").status_code == 200


def test_malformed_http_does_not_hurt_the_server(fake_server):
    port = int(fake_server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 400")
    assert httpx.post(fake_server.url + "/v1/completions", json={"prompt": "fine"}).status_code == 200
