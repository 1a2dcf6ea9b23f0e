"""Issue #19's server items: every bad field a 400 naming it, the key before the body, the Host
allow-list, and the resource limits (connection cap, header deadline, request time limit, drain)."""

import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_helpers import metric, parse_prometheus, running_server, wait_until
from starlette.testclient import TestClient
from test_server_cli import start_server

from exlcli.client import runtime_file
from exlcli.client.fake import FakeClient
from exlcli.server.app import ServerConfig, create_app
from exlcli.server.connections import ConnectionLimits
from exlcli.server.logs import RepeatLimiter

CHAT = {"messages": [{"role": "user", "content": "a b"}]}


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"logit_bias": "x"}, "logit_bias"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"max_completion_tokens": 4097}, "max_completion_tokens"),
    ({"top_k": 2**40}, "top_k"),
    ({"temperature": 2.5}, "temperature"),
    ({"n": 3}, "n"),  # more generations than --max-queue (2) could ever hold
])
def test_bad_fields_are_400s_naming_them(extra, param):
    client = FakeClient(context_length=4096)
    with TestClient(create_app(client, ServerConfig(max_queue=2))) as http:
        response = http.post("/v1/chat/completions", json={**CHAT, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert client.requests == []  # refused before the engine saw it


def test_unknown_model_is_404_and_aliases_are_accepted():
    client = FakeClient(model_name="served")
    with TestClient(create_app(client, ServerConfig(model_aliases=("original",)))) as http:
        missing = http.post("/v1/completions", json={"prompt": "a", "model": "gpt-4"})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found" and missing.json()["error"]["param"] == "model"
        for name in ("served", "original"):
            assert http.post("/v1/completions", json={"prompt": "a", "model": name}).status_code == 200


def test_too_long_prompts_are_context_length_exceeded_and_huge_ones_never_tokenised():
    client = FakeClient(context_length=16)
    with TestClient(create_app(client)) as http:
        over_context = http.post("/v1/completions", json={"prompt": "a " * 40})  # 80 bytes, 40 tokens
        huge = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 600}]})
    assert over_context.status_code == 400
    assert over_context.json()["error"]["code"] == "context_length_exceeded"
    assert over_context.json()["error"]["param"] == "prompt"
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "context_length_exceeded"
    assert huge.json()["error"]["param"] == "messages"
    assert [kind for kind, _, _ in client.requests] == ["complete"]  # the 600-byte one never reached it


def test_413_is_a_response_under_load_and_counted():
    with running_server(FakeClient(), ServerConfig(max_body_bytes=1024)) as live:
        body = json.dumps({"prompt": "a " * 200_000})  # 400 KB against a 1 KB limit

        def post(_):
            return httpx.post(live.url + "/v1/completions", content=body,
                              headers={"Content-Type": "application/json"}, timeout=10)

        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(post, range(16)))  # a reset would raise here
        assert [r.status_code for r in responses] == [413] * 16
        assert responses[0].json()["error"]["code"] == "request_too_large"
        _, samples = parse_prometheus(httpx.get(live.url + "/metrics").text)
    assert metric(samples, "exlcli_http_responses_total", endpoint="/v1/completions", status="413") == 16


def test_key_is_checked_before_the_body_and_health_names_nothing():
    key = "k" * 20
    with TestClient(create_app(FakeClient(), ServerConfig(api_key=key))) as http:
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/openapi.json"), ("GET", "/metrics"),
                             ("POST", "/tokenize"), ("GET", "/no-such-route")):
            response = http.request(method, path, content=b"{not json")
            assert response.status_code == 401, (path, response.text)  # not the 400 a parsed body would give
            assert response.json()["error"]["code"] == "invalid_api_key"
        health = http.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        ok = http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200
    with TestClient(create_app(FakeClient())) as http:
        assert http.get("/health").json() == {"status": "ok", "model": "fake-echo"}


def test_loopback_server_refuses_foreign_host_headers():
    with running_server(FakeClient()) as live:
        port = live.url.rsplit(":", 1)[1]
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
            response = httpx.get(live.url + "/v1/models", headers={"Host": host})
            assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_host"
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
            assert httpx.get(live.url + "/v1/models", headers={"Host": host}).status_code == 200, host
        _, samples = parse_prometheus(httpx.get(live.url + "/metrics").text)
    assert metric(samples, "exlcli_http_responses_total", endpoint="/v1/models", status="400") == 3


def test_cors_is_off_unless_asked():
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    with TestClient(create_app(FakeClient())) as http:
        assert "access-control-allow-origin" not in http.get("/v1/models", headers=preflight).headers
    with TestClient(create_app(FakeClient(), ServerConfig(cors_origins=("http://app.example",)))) as http:
        response = http.options("/v1/chat/completions", headers=preflight)
        assert response.headers["access-control-allow-origin"] == "http://app.example"


def test_slow_headers_are_dropped_while_normal_requests_answer_fast():
    limits = ConnectionLimits(header_timeout_s=0.5)
    with running_server(FakeClient(), limits=limits) as live:
        port = int(live.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as slow:
            slow.settimeout(0.05)
            start = time.monotonic()
            closed_after = None
            for byte in b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"p" * 100:
                try:
                    slow.sendall(bytes([byte]))
                    if slow.recv(1) == b"":
                        closed_after = time.monotonic() - start
                        break
                except socket.timeout:
                    pass
                except OSError:
                    closed_after = time.monotonic() - start
                    break
                t0 = time.monotonic()
                if int(t0 * 20) % 5 == 0:  # now and then, a normal request meanwhile
                    assert httpx.get(live.url + "/v1/models", timeout=2).status_code == 200
                    assert time.monotonic() - t0 < 0.5
            assert closed_after is not None and 0.4 < closed_after < 2.0


def _stream_request(port: int, words: int) -> socket.socket:
    """A socket whose streamed completion runs (slowly) while nobody reads it."""
    body = json.dumps({"prompt": "w " * words, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def test_connections_beyond_the_cap_are_closed_at_accept_when_all_are_busy():
    limits = ConnectionLimits(max_connections=3, header_timeout_s=0.5)
    with running_server(FakeClient(token_delay=0.05), limits=limits) as live:
        port = int(live.url.rsplit(":", 1)[1])
        busy = [_stream_request(port, 400) for _ in range(3)]  # 20 s of tokens each
        try:
            assert wait_until(lambda: len(live.tracker.live) == 3)
            with pytest.raises(httpx.TransportError):
                httpx.get(live.url + "/v1/models", timeout=2)
        finally:
            for s in busy:
                s.close()
        assert wait_until(lambda: httpx.get(live.url + "/v1/models", timeout=2).status_code == 200)


def test_at_the_cap_a_new_connection_takes_the_place_of_the_longest_waiting_one():
    limits = ConnectionLimits(max_connections=3, header_timeout_s=30, body_timeout_s=30)
    with running_server(FakeClient(), limits=limits) as live:
        port = int(live.url.rsplit(":", 1)[1])
        idle = socket.create_connection(("127.0.0.1", port))  # sends nothing
        time.sleep(0.05)
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        for s in slow:  # headers, then a body that never comes
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
        try:
            assert wait_until(lambda: len(live.server.server_state.connections) == 3)
            with httpx.Client(timeout=2) as http:
                for _ in range(4):  # each new connection pushes out the one waiting longest on its client
                    assert http.get(live.url + "/v1/models", headers={"Connection": "close"}).status_code == 200
            idle.settimeout(2)
            assert idle.recv(1) == b""  # the oldest, pushed out first
        finally:
            for s in [idle, *slow]:
                s.close()


def test_a_request_past_its_time_limit_is_cancelled():
    with running_server(FakeClient(token_delay=0.02), ServerConfig(request_timeout_s=0.3)) as live:
        start = time.monotonic()
        reply = httpx.post(live.url + "/v1/completions", json={"prompt": "w " * 500}, timeout=10).json()
        assert time.monotonic() - start < 2
    assert reply["choices"][0]["finish_reason"] != "stop"
    assert len(reply["choices"][0]["text"].split()) < 100


def test_repeated_log_lines_are_rate_limited():
    clock = [0.0]
    limiter = RepeatLimiter(per_interval=3, interval_s=10, clock=lambda: clock[0])

    def record(msg):
        import logging
        return logging.LogRecord("exlcli.server", logging.WARNING, __file__, 1, msg, (), None)

    passed = [limiter.filter(record("accept failed: %s")) for _ in range(1000)]
    assert sum(passed) == 3
    assert limiter.filter(record("another line"))
    clock[0] = 11
    summary = record("accept failed: %s")
    assert limiter.filter(summary) and "997 more like it" in summary.msg


def test_sigterm_drain_ends_within_the_drain_timeout_with_an_unread_stream(private_runtime_dir):
    proc = start_server("--drain-timeout", "1")
    try:
        assert wait_until(lambda: runtime_file.find_running_server() is not None or proc.poll() is not None, 20)
        url = runtime_file.find_running_server()
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({"prompt": "w " * 1500, "stream": True}).encode()  # 75 s of tokens at 0.05 s
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            time.sleep(0.5)  # streaming, never read
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0
            assert time.monotonic() - start < 4  # the 1 s drain timeout, not the 75 s stream
        _, err = proc.communicate()
        assert "Traceback" not in err
        assert "Cancel 1 running task(s), timeout graceful shutdown exceeded" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_soak_of_thousands_of_requests_with_cancels_and_bad_bodies():
    soak_fake_server(1400, hang_guard_s=30)


@pytest.mark.slow
def test_soak_of_3500_requests_with_cancels_and_bad_bodies():
    soak_fake_server(3500, hang_guard_s=300)


def soak_fake_server(num: int, hang_guard_s: float) -> None:
    """`num` requests, 24 at a time, of seven kinds (a seventh each: fine, a stream the client hangs up
    on, bad JSON, a bad field, a body over the cap, a foreign Host header, an unknown model): every one
    gets its status, nothing is left running, the server still answers and counted every 413."""
    import asyncio

    kinds = ["ok", "stream_cancel", "bad_json", "bad_field", "too_big", "bad_host", "unknown_model"]
    expected = {"ok": 200, "stream_cancel": 200, "bad_json": 400, "bad_field": 400, "too_big": 413,
                "bad_host": 400, "unknown_model": 404}
    with running_server(FakeClient(token_delay=0.0005), ServerConfig(max_body_bytes=2048)) as live:
        async def one(http: httpx.AsyncClient, i: int) -> tuple[str, int]:
            kind = kinds[i % len(kinds)]
            url = live.url + "/v1/completions"
            if kind == "stream_cancel":
                async with http.stream("POST", url, json={"prompt": "w " * 20, "stream": True}) as response:
                    async for _ in response.aiter_lines():
                        break  # hang up after the first line
                return kind, response.status_code
            if kind == "bad_json":
                response = await http.post(url, content=b'{"prompt": ', headers={"Content-Type": "application/json"})
            elif kind == "bad_field":
                response = await http.post(url, json={"prompt": "a", "top_p": 7})
            elif kind == "too_big":
                response = await http.post(url, json={"prompt": "a " * 4000})
            elif kind == "bad_host":
                response = await http.post(url, json={"prompt": "a"}, headers={"Host": "rebind.example"})
            elif kind == "unknown_model":
                response = await http.post(url, json={"prompt": "a", "model": "nope"})
            else:
                response = await http.post(url, json={"prompt": f"a b {i}", "max_tokens": 3})
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            return kind, response.status_code

        async def soak() -> list[tuple[str, int]]:
            limits = httpx.Limits(max_connections=24)
            async with httpx.AsyncClient(timeout=10, limits=limits) as http:
                gate = asyncio.Semaphore(24)

                async def bounded(i):
                    async with gate:
                        return await one(http, i)

                return await asyncio.gather(*(bounded(i) for i in range(num)))

        start = time.monotonic()
        results = asyncio.run(soak())
        assert time.monotonic() - start < hang_guard_s  # a hang, not a speed bound
        assert all(status == expected[kind] for kind, status in results), \
            [r for r in results if r[1] != expected[r[0]]][:5]
        assert wait_until(lambda: not live.tracker.live and not live.state.groups, 5)  # nothing leaked
        assert httpx.get(live.url + "/health").status_code == 200
        _, samples = parse_prometheus(httpx.get(live.url + "/metrics").text)
    assert metric(samples, "exlcli_http_responses_total", endpoint="/v1/completions", status="413") == \
        sum(1 for i in range(num) if kinds[i % len(kinds)] == "too_big")


def test_runtime_folder_is_made_private_or_refused(private_runtime_dir, monkeypatch):
    import os
    import stat

    from exlcli.errors import ExlcliError

    private_runtime_dir.mkdir(mode=0o777)
    os.chmod(private_runtime_dir, 0o777)
    note = runtime_file.secure_runtime_dir()
    assert note == f"the runtime folder {private_runtime_dir} was mode 0777; now 0700"
    assert stat.S_IMODE(private_runtime_dir.stat().st_mode) == 0o700
    assert runtime_file.secure_runtime_dir() is None  # already private: nothing to say
    os.chmod(private_runtime_dir, 0o755)
    runtime_file.write_record(runtime_file.ServerRecord(url="http://127.0.0.1:1", pid=os.getpid(), model="m"))
    assert stat.S_IMODE(private_runtime_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(runtime_file.runtime_path().stat().st_mode) == 0o600
    monkeypatch.setattr(os, "getuid", lambda: os.stat(private_runtime_dir).st_uid + 1)
    with pytest.raises(ExlcliError, match="belongs to another user"):
        runtime_file.secure_runtime_dir()


def test_prompts_are_tokenised_a_bounded_number_at_a_time_off_the_event_loop():
    import threading

    class SlowTokenizer(FakeClient):
        def __init__(self):
            super().__init__()
            self.lock, self.now, self.most = threading.Lock(), 0, 0

        def complete(self, prompt, params):
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
            time.sleep(0.1)  # a long prompt's tokenising
            with self.lock:
                self.now -= 1
            return super().complete(prompt, params)

    client = SlowTokenizer()
    with running_server(client, ServerConfig(max_tokenizing=2)) as live, httpx.Client(timeout=2) as http:
        http.get(live.url + "/health")
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(httpx.post, live.url + "/v1/completions", json={"prompt": "a"}, timeout=10)
                       for _ in range(6)]
            time.sleep(0.05)
            start = time.monotonic()
            assert http.get(live.url + "/health").status_code == 200  # the loop is free meanwhile
            assert time.monotonic() - start < 0.25
            assert all(f.result().status_code == 200 for f in futures)
    assert client.most == 2
