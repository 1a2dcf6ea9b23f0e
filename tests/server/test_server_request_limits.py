"""Issue #56's server items: no request content is worked on the event loop (grammar checks in
killable worker processes with a budget, starts and /tokenize in threads with one), every field that
reaches the template counts toward the prompt cap, slow bodies and big headers have limits, the
connection cap fits the fd limit, /health answers 503 through a drain, completions logprobs, and
sessions under an API key."""

import json
import signal
import socket
import threading
import time

import httpx
import pytest
from server_helpers import LogprobFakeClient, running_server, wait_until
from starlette.testclient import TestClient
from test_server_cli import start_server

from exlcli.client import runtime_file
from exlcli.client.fake import FakeClient
from exlcli.server import connections
from exlcli.server.app import ServerConfig, create_app
from exlcli.server.connections import ConnectionLimits, fit_fd_limit

# llguidance's emptiness check of this string doubles with each pattern: ~40 s for 20 of them.
PATHOLOGICAL = {"type": "object", "properties": {"s": {
    "type": "string", "allOf": [{"pattern": f".*{chr(97 + i)}.*"} for i in range(20)]}}}


def chat(content: str = "hi", **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], **extra}


def tool(name: str = "f", parameters: dict | None = None, description: str | None = None) -> dict:
    function: dict = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def slow_body_connections(port: int, count: int) -> list[socket.socket]:
    """Sockets that sent their headers and one byte of a 1000-byte body."""
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{")
        socks.append(s)
    return socks


def test_health_and_a_running_stream_keep_answering_under_schema_tool_and_slow_body_attacks(private_runtime_dir):
    proc = start_server()  # `exlcli serve --model fake:echo:0.05` in its own process, as deployed
    try:
        assert wait_until(lambda: runtime_file.find_running_server() is not None or proc.poll() is not None, 30)
        url = runtime_file.find_running_server()
        port = port_of(url)
        chunk_times: list[float] = []
        first = threading.Event()

        def stream() -> None:  # 200 tokens at 0.05 s: 10 s of stream
            with httpx.stream("POST", url + "/v1/completions", json={"prompt": "w " * 200, "stream": True},
                              timeout=30) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        chunk_times.append(time.monotonic())
                        first.set()

        results: dict[str, httpx.Response] = {}

        def post(name: str, body: bytes) -> None:
            results[name] = httpx.post(url + "/v1/chat/completions", content=body, timeout=60,
                                       headers={"Content-Type": "application/json"})

        streamer = threading.Thread(target=stream)
        streamer.start()
        assert first.wait(10)
        # encoded up front, so the probes' timings are the server's, not this process's JSON work
        attacks = [threading.Thread(target=post, args=(name, json.dumps(body).encode())) for name, body in (
            ("tool_schema", chat(tools=[tool(parameters=PATHOLOGICAL)])),
            ("response_format", chat(response_format=schema_format(PATHOLOGICAL))),
            ("big_description", chat(tools=[tool(description="d" * 4_000_000)])))]
        slow = slow_body_connections(port, 64)
        try:
            latencies = []
            with httpx.Client(timeout=10) as http:
                assert http.get(url + "/health").status_code == 200  # connected
                start = time.monotonic()
                for t in attacks:
                    t.start()
                while time.monotonic() - start < 3.0:  # the attacks are in flight meanwhile
                    t0 = time.monotonic()
                    assert http.get(url + "/health").status_code == 200
                    latencies.append(time.monotonic() - t0)
                    time.sleep(0.05)
            end = time.monotonic()
            for t in attacks:
                t.join(30)
        finally:
            for s in slow:
                s.close()
        streamer.join(30)
    finally:
        proc.kill()
        proc.wait()
    assert len(latencies) >= 10 and max(latencies) < 0.5, latencies
    during = [b - a for a, b in zip(chunk_times, chunk_times[1:]) if start <= b <= end]
    assert len(during) >= 10 and max(during) < 0.5, during
    for name in ("tool_schema", "response_format"):
        error = results[name].json()["error"]
        assert results[name].status_code == 400 and "2000 ms" in error["message"], error
    assert results["tool_schema"].json()["error"]["param"] == "tools.0.function.parameters"
    assert results["response_format"].json()["error"]["param"] == "response_format"
    big = results["big_description"]
    assert big.status_code == 400 and big.json()["error"]["code"] == "context_length_exceeded"
    assert big.json()["error"]["param"] == "tools"


def test_grammar_checks_have_their_own_slots_so_slow_schemas_do_not_stall_other_requests():
    config = ServerConfig(grammar_budget_ms=2000, max_grammar_checks=2, max_tokenizing=2)
    with running_server(FakeClient(), config) as live:
        refused: list[httpx.Response] = []
        slow = [threading.Thread(target=lambda: refused.append(httpx.post(
            live.url + "/v1/chat/completions", json=chat(response_format=schema_format(PATHOLOGICAL)), timeout=30)))
            for _ in range(2)]
        with httpx.Client(timeout=10) as http:
            assert http.post(live.url + "/v1/chat/completions", json=chat()).status_code == 200
            for t in slow:
                t.start()
            time.sleep(0.3)  # both grammar slots busy for their 2 s budget
            for _ in range(5):  # each well under that: they wait for no grammar slot
                t0 = time.monotonic()
                assert http.post(live.url + "/v1/chat/completions", json=chat()).status_code == 200
                assert time.monotonic() - t0 < 1.0
            t0 = time.monotonic()
            good = http.post(live.url + "/v1/chat/completions", json=chat(response_format=schema_format(
                {"type": "object", "properties": {"a": {"type": "integer"}}})))
        for t in slow:
            t.join(30)
    assert good.status_code == 200  # waited for a grammar slot, at most the budget
    assert [r.status_code for r in refused] == [400, 400]
    assert all("2000 ms" in r.json()["error"]["message"] for r in refused)


def test_a_bad_schema_is_still_a_400_naming_its_field():
    with TestClient(create_app(FakeClient())) as http:
        bad = http.post("/v1/chat/completions", json=chat(response_format=schema_format({"type": "objekt"})))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    assert "invalid JSON schema" in bad.json()["error"]["message"]


def test_every_field_that_reaches_the_template_counts_toward_the_prompt_cap():
    client = FakeClient(context_length=64)  # 64 x 32 = 2048 bytes
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"x": "a" * 3000})}}
    with TestClient(create_app(client)) as http:
        description = http.post("/v1/chat/completions", json=chat(tools=[tool(description="d" * 3000)]))
        schema = http.post("/v1/chat/completions", json=chat(tools=[tool(parameters={
            "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}})]))
        arguments = http.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]})
        result = http.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
                {**call, "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c" * 3000, "content": "ok"}]})
        tokenize = http.post("/tokenize", json={"messages": [{"role": "user", "content": "a " * 1500}]})
        fits = http.post("/v1/chat/completions", json=chat(tools=[tool(description="d" * 100)]))
    for response, param in ((description, "tools"), (schema, "tools"), (arguments, "messages"),
                            (result, "messages"), (tokenize, "messages")):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "context_length_exceeded"
        assert response.json()["error"]["param"] == param
    assert fits.status_code == 200
    assert len(client.requests) == 1  # only the one that fits reached the engine


def test_a_start_past_its_budget_is_a_400_and_its_late_stream_is_cancelled():
    class SlowTemplate(FakeClient):
        def __init__(self):
            super().__init__()
            self.streams = []

        def chat(self, messages, params):
            time.sleep(0.6)  # a template render that takes too long
            stream = super().chat(messages, params)
            self.streams.append(stream)
            return stream

    client = SlowTemplate()
    with running_server(client, ServerConfig(start_budget_ms=200)) as live, httpx.Client(timeout=10) as http:
        t0 = time.monotonic()
        late = http.post(live.url + "/v1/chat/completions", json=chat())
        assert time.monotonic() - t0 < 0.5
        assert late.status_code == 400 and "200 ms" in late.json()["error"]["message"]
        assert wait_until(lambda: len(client.streams) == 1 and client.streams[0]._cancelled.is_set())


def test_content_length_over_the_limit_is_a_413_at_once_whatever_it_says():
    with running_server(FakeClient(), ServerConfig(max_body_bytes=1 << 20)) as live:
        for length in (5 * (1 << 20), 10**20):
            with socket.create_connection(("127.0.0.1", port_of(live.url))) as s:
                s.settimeout(5)
                t0 = time.monotonic()
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: " + str(length).encode() + b"\r\n\r\n{}")
                head = s.recv(4096)
                assert time.monotonic() - t0 < 1.0
                assert head.startswith(b"HTTP/1.1 413 "), head


def test_a_body_that_does_not_arrive_in_time_gets_a_408_and_frees_its_connection():
    limits = ConnectionLimits(body_timeout_s=0.5, header_timeout_s=5)
    with running_server(FakeClient(), limits=limits) as live:
        with socket.create_connection(("127.0.0.1", port_of(live.url))) as s:
            s.settimeout(5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
            t0 = time.monotonic()
            received = b""
            for _ in range(40):  # a byte every 0.05 s does not move the deadline
                try:
                    s.sendall(b" ")
                except OSError:
                    break
                s.settimeout(0.05)
                try:
                    chunk = s.recv(4096)
                except socket.timeout:
                    continue
                received += chunk
                if not chunk or b"\r\n\r\n" in received:
                    break
            elapsed = time.monotonic() - t0
        assert received.startswith(b"HTTP/1.1 408 "), received
        assert 0.4 < elapsed < 1.5
        assert wait_until(lambda: len(live.server.server_state.connections) == 0)


@pytest.mark.parametrize("headers, words", [
    (b"".join(b"X-H%d: 1\r\n" % i for i in range(150)), b"at most 100 header fields"),
    (b"X-Big: " + b"b" * 40_000 + b"\r\n", b"larger than 16384 bytes"),
], ids=["count", "size"])
def test_too_many_or_too_big_headers_are_a_431(headers, words):
    with running_server(FakeClient()) as live:
        with socket.create_connection(("127.0.0.1", port_of(live.url))) as s:
            s.settimeout(5)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers + b"\r\n")
            reply = b""
            for _ in range(100):
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 431 ") and words in reply, reply[:300]


def test_max_connections_fits_the_fd_limit(monkeypatch):
    limits_now = {"soft": 1024, "hard": 4096}

    def getrlimit(_):
        return limits_now["soft"], limits_now["hard"]

    def setrlimit(_, value):
        soft, hard = value
        assert hard == limits_now["hard"] and soft <= hard
        limits_now["soft"] = soft

    monkeypatch.setattr(connections.resource, "getrlimit", getrlimit)
    monkeypatch.setattr(connections.resource, "setrlimit", setrlimit)
    fitted, note = fit_fd_limit(ConnectionLimits(max_connections=2000))
    assert fitted.max_connections == 2000 and note is None and limits_now["soft"] == 2000 + connections.RESERVED_FDS
    fitted, note = fit_fd_limit(ConnectionLimits(max_connections=10_000))
    assert fitted.max_connections == 4096 - connections.RESERVED_FDS
    assert note is not None and "--max-connections 10000" in note and "ulimit -n" in note


def test_health_answers_503_through_a_drain(private_runtime_dir):
    proc = start_server("--drain-timeout", "3")
    try:
        assert wait_until(lambda: runtime_file.find_running_server() is not None or proc.poll() is not None, 20)
        url = runtime_file.find_running_server()
        streamer = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json={"prompt": "w " * 400},
                                                             timeout=30))  # 20 s of tokens, cut by the drain
        streamer.start()
        assert wait_until(lambda: httpx.get(url + "/stats", timeout=2).json()["num_running"] == 1, 10)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        statuses = []
        with httpx.Client(timeout=2) as http:
            while time.monotonic() - start < 2:  # within the 3 s drain
                statuses.append(http.get(url + "/health").status_code)  # a refused connection would raise
                refused = http.post(url + "/v1/completions", json={"prompt": "a"})
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
                time.sleep(0.05)
        assert len(statuses) >= 5 and set(statuses) == {503}
        assert proc.wait(10) == 0
        streamer.join(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_completions_logprobs_0_gives_the_sampled_tokens_and_top_entries_never_collide():
    class SameText(LogprobFakeClient):
        def token_text(self, token_id: int) -> str:
            return "<x>" if token_id >= 1000 else f"<{token_id}>"  # 1000+i reads as 1000+j

    with TestClient(create_app(LogprobFakeClient())) as http:
        zero = http.post("/v1/completions", json={"prompt": "a b", "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert zero["token_logprobs"] == pytest.approx([-0.1, -0.2, -0.3])
    assert zero["top_logprobs"] == [{"<0>": pytest.approx(-0.1)}, {"<1>": pytest.approx(-0.2)},
                                    {"<2>": pytest.approx(-0.3)}]
    with TestClient(create_app(SameText())) as http:
        reply = http.post("/v1/completions", json={"prompt": "a b", "logprobs": 2}).json()["choices"][0]["logprobs"]
    assert reply["top_logprobs"][1] == {"<1>": pytest.approx(-0.2), "<x>": pytest.approx(-5.0)}
    assert [[e["token_id"] for e in top] for top in reply["top_tokens"]] == [[0, 1000], [1, 1001], [2, 1002]]


def test_sessions_are_scoped_to_the_api_key():
    key = "k" * 20
    client = FakeClient()
    with TestClient(create_app(client, ServerConfig(api_key=key))) as http:
        auth = {"Authorization": f"Bearer {key}"}
        assert http.post("/v1/chat/completions", json=chat(session="talk"), headers=auth).status_code == 200
        assert http.post("/v1/completions", json={"prompt": "a", "session": "talk"}, headers=auth).status_code == 200
    with TestClient(create_app(FakeClient())) as http:
        open_client = http.app.state.exlcli.client
        assert http.post("/v1/completions", json={"prompt": "a", "session": "talk"}).status_code == 200
    sessions = [params.session for _, _, params in client.requests]
    assert sessions[0] == sessions[1] != "talk" and sessions[0].endswith("/talk") and key not in sessions[0]
    assert [params.session for _, _, params in open_client.requests] == ["talk"]  # no key: the name as sent


def test_a_check_over_its_budget_ends_with_its_worker_process():
    import asyncio
    import os

    from exlcli.server.grammar_workers import GrammarCheck, GrammarRejected, GrammarWorkers

    workers = GrammarWorkers(max_at_once=1, budget_ms=300)

    async def run() -> tuple[list[int], str]:
        ok = asyncio.create_task(workers.check([GrammarCheck("response_format", "regex", "[a-z]+")]))
        await ok  # a worker is started and kept
        pids = [w.proc.pid for w in workers._all]
        with pytest.raises(GrammarRejected) as e:
            await workers.check([GrammarCheck("tools.0.function.parameters", "json_schema", PATHOLOGICAL)])
        return pids, str(e.value)

    try:
        pids, message = asyncio.run(run())
    finally:
        workers.close()
    assert "300 ms" in message
    assert len(pids) == 1 and not os.path.exists(f"/proc/{pids[0]}")  # killed and reaped, not left running
