"""/metrics parses as Prometheus text and counts what happened; the safety rules hold."""

import dataclasses
import socket

import httpx
import pytest
from server_helpers import FakeClock, SchedulingFakeClient, metric, parse_prometheus, running_server
from starlette.testclient import TestClient

from exlcli.client.fake import FakeClient
from exlcli.client.runtime_file import is_loopback_host
from exlcli.engine.stats import STEP_TIME_BUCKETS, EngineStats
from exlcli.errors import ExlcliError
from exlcli.server.app import ServerConfig, create_app
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
    types, samples = parse_prometheus(response.text)  # every family typed: none "unknown"
    assert types["vllm:time_to_first_token_seconds"] == "histogram"
    assert types["vllm:inter_token_latency_seconds"] == "histogram"
    assert types["exlcli_kv_pages_free"] == "gauge"
    assert types["vllm:generation_tokens"] == types["exlcli_server_generations_finished"] == "counter"
    model = {"model_name": "fake-echo"}
    assert metric(samples, "vllm:generation_tokens_total", **model) == 3 * 4 + 1
    assert metric(samples, "vllm:time_to_first_token_seconds_count", **model) == 4
    assert metric(samples, "vllm:e2e_request_latency_seconds_count", **model) == 4
    assert metric(samples, "vllm:request_queue_time_seconds_count", **model) == 4
    assert metric(samples, "vllm:inter_token_latency_seconds_count", **model) == 3 * 3  # tokens after the first
    assert metric(samples, "vllm:request_success_total", finished_reason="length", **model) == 1
    assert metric(samples, "exlcli_server_generations_finished_total", reason="stop") == 3
    assert metric(samples, "exlcli_server_generations_finished_total", reason="length") == 1
    assert metric(samples, "exlcli_http_responses_total", endpoint="/v1/completions", status="200") == 4
    assert metric(samples, "exlcli_http_responses_total", endpoint="/v1/completions", status="400") == 1
    assert metric(samples, "exlcli_kv_pages_used") == 0
    assert metric(samples, "vllm:num_requests_running", **model) == 0
    assert metric(samples, "vllm:kv_cache_usage_perc", **model) == 0
    for family, kind in types.items():  # every histogram: cumulative buckets ending at +Inf == count
        if kind != "histogram":
            continue
        buckets = [(labels["le"], v) for n, labels, v in samples if n == family + "_bucket"]
        assert buckets[-1][0] == "+Inf"
        values = [v for _, v in buckets]
        assert values == sorted(values)
        assert values[-1] == metric(samples, family + "_count")


def test_openmetrics_when_the_scraper_asks():
    client = SchedulingFakeClient()
    with running_server(client) as live:
        response = httpx.get(live.url + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")


class StepStatsClient(FakeClient):
    def stats(self) -> EngineStats:
        return EngineStats(pages_total=10, pages_used=3, pages_cached=2, num_steps=5, step_time_sum_s=0.5,
                           step_time_bucket_counts=[1, 0, 0, 2, 0, 0, 0, 0, 0, 0, 2], num_preemptions=4,
                           prefix_cache_queries=40, prefix_cache_hits=30)


def scrape(app) -> list:
    with TestClient(app) as http:
        _, samples = parse_prometheus(http.get("/metrics").text)
    return samples


def test_engine_counts_come_from_engine_stats():
    samples = scrape(create_app(StepStatsClient()))
    assert metric(samples, "exlcli_step_time_seconds_bucket", le=str(STEP_TIME_BUCKETS[0])) == 1
    assert metric(samples, "exlcli_step_time_seconds_bucket", le=str(STEP_TIME_BUCKETS[3])) == 3
    assert metric(samples, "exlcli_step_time_seconds_bucket", le="+Inf") == 5
    assert metric(samples, "exlcli_step_time_seconds_sum") == 0.5
    assert metric(samples, "exlcli_kv_pages_free") == 5
    assert metric(samples, "vllm:kv_cache_usage_perc", model_name="fake-echo") == 0.3
    assert metric(samples, "vllm:gpu_cache_usage_perc", model_name="fake-echo") == 0.3
    assert metric(samples, "vllm:num_preemptions_total", model_name="fake-echo") == 4
    assert metric(samples, "vllm:prefix_cache_hits_total", model_name="fake-echo") == 30


def test_each_app_has_its_own_registry():
    first, second = create_app(FakeClient()), create_app(FakeClient())
    with TestClient(first) as http:
        http.post("/v1/completions", json={"prompt": "a b"})
    assert metric(scrape(first), "vllm:e2e_request_latency_seconds_count", model_name="fake-echo") == 1
    assert metric(scrape(second), "vllm:e2e_request_latency_seconds_count", model_name="fake-echo") == 0


class IdleAfterBurstClient(FakeClient):
    """An engine that generated 100 tokens in a burst and then stopped; like the real engine, its
    own tokens_per_s and last_batch_size keep their last busy values."""

    def __init__(self) -> None:
        super().__init__()
        self.view = EngineStats(num_running=1, last_batch_size=4, tokens_per_s=30.0, num_steps=1,
                                last_step_tokens=4, last_step_time_s=0.02)

    def stats(self) -> EngineStats:
        return dataclasses.replace(self.view)


def test_rates_fall_to_zero_when_idle():
    clock = FakeClock()
    client = IdleAfterBurstClient()
    app = create_app(client, tracker=RequestTracker(model_name="fake-echo", clock=clock))
    assert metric(scrape(app), "exlcli_generation_tokens_per_second") == 0.0
    clock.now += 1.0
    client.view.total_generated_tokens, client.view.num_steps = 100, 26
    busy = scrape(app)
    assert metric(busy, "exlcli_generation_tokens_per_second") == 100.0
    assert metric(busy, "exlcli_batch_size") == 4
    client.view.num_running = 0  # idle from now on; the engine's own figures stay as they were
    for _ in range(3):
        clock.now += 3.0
        idle = scrape(app)
    assert metric(idle, "exlcli_generation_tokens_per_second") == 0.0
    assert metric(idle, "exlcli_batch_size") == 0 and metric(idle, "exlcli_step_tokens") == 0


def test_loopback_rules():
    assert all(is_loopback_host(h) for h in ("127.0.0.1", "127.5.0.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback_host(h) for h in ("0.0.0.0", "::", "192.168.1.4", "example.com"))
    check_bind_allowed("127.0.0.1", None)
    check_bind_allowed("0.0.0.0", "k" * 16)
    check_bind_allowed("127.0.0.1", "k")  # a short key is fine where only this machine can connect
    with pytest.raises(ExlcliError, match="with a key of 15 characters: a key for a public address needs at least 16"):
        check_bind_allowed("0.0.0.0", "k" * 15)
    with pytest.raises(ExlcliError, match="refusing to listen on 0.0.0.0 without an API key"):
        check_bind_allowed("0.0.0.0", None)


def test_key_comparison():
    assert key_matches("abc", "abc")
    assert not key_matches("abd", "abc")
    assert not key_matches(None, "abc")
    assert not key_matches("ab", "abc")
    assert not key_matches("\udcff", "abc")  # undecodable input does not crash the compare


def test_body_size_limit_by_length_and_while_streaming():
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
