"""SSE through sse-starlette: OpenAI's bytes exactly, keep-alive pings on an idle stream, and clients
(the openai SDK, exlcli's RemoteClient) that read through the pings."""

import httpx
import openai
from server_helpers import SchedulingFakeClient, running_server, wait_until

from exlcli.client.base import GenerationParams
from exlcli.client.fake import FakeClient
from exlcli.client.remote import RemoteClient
from exlcli.server.app import ServerConfig
from exlcli.server.sse import DONE, sse_data


def test_encoding_is_openais():
    assert sse_data({"a": "é\nb"}) == b'data: {"a":"\\u00e9\\nb"}\n\n'
    assert DONE == b"data: [DONE]\n\n"


def test_stream_bytes_are_data_lines_then_done(fake_server):
    body = {"prompt": "a b", "stream": True}
    with httpx.stream("POST", fake_server.url + "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(response.iter_bytes())
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    assert all(e.startswith(b"data: {") for e in events[:-2])
    assert b"\r" not in raw


def test_pings_arrive_while_the_request_waits_in_the_queue():
    client = SchedulingFakeClient(max_running=1, token_delay=0.001)
    client.running_allowed.clear()  # every request stays in the engine's queue
    with running_server(client, ServerConfig(sse_ping_s=0.05)) as live:
        body = {"messages": [{"role": "user", "content": "x y"}], "stream": True}
        with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=10) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # the role chunk
            assert next(lines) == ""
            pings = 0
            for line in lines:
                if line.startswith(": ping"):
                    pings += 1
                    if pings == 3:
                        break
                else:
                    assert line == "", f"only pings while queued, got {line!r}"
            client.running_allowed.set()
            rest = [line for line in lines if line.startswith("data: ")]
    assert pings == 3
    assert rest[-1] == "data: [DONE]"


def test_clients_read_through_pings():
    with running_server(FakeClient(token_delay=0.02), ServerConfig(sse_ping_s=0.005)) as live:
        stream = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model="fake-echo", messages=[{"role": "user", "content": "one two three four"}], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "echo: one two three four"
        remote = RemoteClient(live.url)
        try:
            text = "".join(d.text for d in remote.complete("p q r", GenerationParams()))
        finally:
            remote.close()
        assert text.endswith("p q r")


def test_client_leaving_a_queued_stream_cancels_it_at_once():
    client = SchedulingFakeClient(max_running=1, token_delay=0.001)
    client.running_allowed.clear()
    with running_server(client, ServerConfig(sse_ping_s=60)) as live:
        body = {"prompt": "x", "stream": True}
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=10):
            assert wait_until(lambda: len(live.tracker.live) == 1)
        assert wait_until(lambda: not live.tracker.live, 2)
        assert live.tracker.finished_by_reason["cancelled"] == 1
