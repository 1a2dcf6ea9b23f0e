"""Fuzzed request bodies against a real server: only 2xx or 4xx (with an OpenAI error body),
never a 5xx, and the server still answers afterwards."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import running_server

from exlcli.client.fake import FakeClient

scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats() | st.text(max_size=12))
wild = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)

# Values of the right JSON type, often out of range: these reach the engine when they pass.
typed_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"])},
    optional={"content": st.text(max_size=30) | st.none()
              | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url"]),
                                                "text": st.text(max_size=10)}), max_size=2),
              "name": st.text(max_size=5)})
typed_sampling = {
    "model": st.sampled_from(["fake-echo", "other"]) | st.none(), "max_tokens": st.integers(-2, 40) | st.none(),
    "temperature": st.floats(-1, 3) | st.none(), "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-3, 50),
    "min_p": st.floats(-0.5, 1.5), "repetition_penalty": st.floats(-1, 12),
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "seed": st.integers(-(2**64), 2**64) | st.none(),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=20) | st.none(),
    "n": st.integers(-1, 20), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "priority": st.sampled_from(["interactive", "batch", "urgent"]),
    "client": st.sampled_from(["chat", "batch", "bench", "x y", "", "a" * 40]),
}
typed_chat = st.fixed_dictionaries({"messages": st.lists(typed_message, max_size=3)}, optional={
    "logprobs": st.booleans(), "top_logprobs": st.integers(-2, 25), "max_completion_tokens": st.integers(-1, 40),
    "tools": st.just([]) | st.none(), "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    **typed_sampling})
typed_completion = st.fixed_dictionaries({"prompt": st.text(max_size=40) | st.lists(st.text(max_size=10), max_size=70)},
                                         optional={"logprobs": st.integers(-2, 25) | st.none(),
                                                   "echo": st.booleans(), "suffix": st.none() | st.text(max_size=3),
                                                   "best_of": st.integers(-1, 20), **typed_sampling})


def wild_fields(typed: dict) -> dict:
    return {name: strategy | wild for name, strategy in typed.items()}


chat_bodies = typed_chat | st.fixed_dictionaries({}, optional=wild_fields({
    "messages": st.lists(typed_message, max_size=3), "logprobs": st.booleans(), "top_logprobs": st.integers(),
    "tools": wild, **typed_sampling}))
completion_bodies = typed_completion | st.fixed_dictionaries({}, optional=wild_fields({
    "prompt": st.text(max_size=40), "logprobs": st.integers(), "echo": st.booleans(), **typed_sampling}))
raw_bodies = st.binary(max_size=60) | st.sampled_from([
    b"", b"{", b"[]", b"null", b'{"messages": NaN}', b'{"prompt": "a", "max_tokens": 1e999}',
    b'{"prompt": "\\ud800"}', b'{"messages": [{"role": "user", "content": "\\udfff x"}]}',
    b'{"prompt": "a", "temperature": Infinity}', b"\xff\xfe{}", b'{"prompt": "a"' + b" " * 10 + b"}"])


@pytest.fixture(scope="module")
def live():
    with running_server(FakeClient()) as server:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            yield server, http


def check(http: httpx.Client, path: str, content: bytes) -> None:
    response = http.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code < 500, (path, content, response.status_code, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert error["type"] == "invalid_request_error"
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert all("error" not in json.loads(e[6:]) for e in events[:-1])
    else:
        assert response.json()["choices"]


def dumps(body) -> bytes:
    return json.dumps(body).encode()  # floats may become NaN / Infinity, which Python's parser accepts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=chat_bodies)
def test_fuzzed_chat_bodies_get_no_5xx(live, body):
    check(live[1], "/v1/chat/completions", dumps(body))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=completion_bodies)
def test_fuzzed_completion_bodies_get_no_5xx(live, body):
    check(live[1], "/v1/completions", dumps(body))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=raw_bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize"]))
def test_malformed_bytes_get_no_5xx(live, raw, path):
    check(live[1], path, raw)


def test_server_still_serves_after_fuzzing(live):
    server, http = live
    reply = http.post("/v1/completions", json={"prompt": "alive"})
    assert reply.json()["choices"][0]["text"] == "echo: alive"
    assert server.tracker.responses_by_status.get(("/v1/completions", 500), 0) == 0
    assert not server.tracker.live  # nothing left running
