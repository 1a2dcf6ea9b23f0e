"""Anthropic's Messages API through the official anthropic SDK against a real uvicorn: on the echo
engine (answers, streams whose every event validates against the SDK's own types, tool calls and
their results, count_tokens, stop sequences, errors in Anthropic's shape naming the field), and a
forced tool call round trip on the tiny random model."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter
from server_helpers import running_server
from test_server_openai_sdk import sdk as openai_sdk

from exlcli.client.base import TextDelta
from exlcli.client.fake import FakeClient, FakeStream
from exlcli.client.local import LocalClient
from exlcli.engine.engine import EngineConfig
from exlcli.model.architectures import build_model
from exlcli.model.loader import LoadedModel
from exlcli.model.random_weights import random_config, random_tensors
from exlcli.server import anthropic_events
from exlcli.server.app import ServerConfig
from exlcli.text.chat_template import ChatTemplate
from tests.engine.grammar_helpers import small_bpe_tokenizer
from tests.text.tool_templates import QWEN25

WEATHER = {"name": "get_weather", "description": "The weather in a city now.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                             "unit": {"enum": ["c", "f"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "The time in a time zone.",
        "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                         "required": ["zone"], "additionalProperties": False}}
TOOLS = [WEATHER, TIME]
# The echo engine repeats the user's words: a call in them comes back as the model's call.
CALL = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}</tool_call>'
EVENT = TypeAdapter(RawMessageStreamEvent)


def client(live, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key=kwargs.pop("api_key", "unused"), max_retries=0, **kwargs)


def user(text) -> list[dict]:
    return [{"role": "user", "content": text}]


def raw_events(live, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """The stream as sent: (the `event:` line's name, the data), every data validated by the SDK's
    own event types, the name always the data's type."""
    events = []
    with httpx.stream("POST", live.url + "/v1/messages", json={**body, "stream": True}, headers=headers,
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert name == data["type"], (name, data)
                if name == "ping":
                    assert data == {"type": "ping"}
                elif name != "error":
                    EVENT.validate_python(data)  # raises on any field the SDK's types do not allow
                events.append((name, data))
                name = None
    return events


def check_sequence(events: list[tuple[str, dict]]) -> None:
    """Anthropic's order: message_start, blocks (start, deltas of that index, stop), message_delta,
    message_stop; pings anywhere after message_start."""
    names = [n for n, _ in events if n != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    assert "ping" in [n for n, _ in events]
    open_index, next_index = None, 0
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index, next_index = data["index"], next_index + 1
        elif name == "content_block_delta":
            assert data["index"] == open_index
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
    assert open_index is None


# ---- answers ------------------------------------------------------------------------------------

def test_message_whole(fake_server):
    blocks = [{"type": "text", "text": "hello big"}, {"type": "text", "text": "world"}]
    # (the SDK of late 2026 no longer has the sampling fields; older clients send them)
    reply = client(fake_server).messages.create(
        model="fake-echo", max_tokens=64, system=[{"type": "text", "text": "be brief"}],
        messages=[{"role": "user", "content": blocks}], metadata={"user_id": "someone"},
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40})
    assert reply.type == "message" and reply.role == "assistant" and reply.model == "fake-echo"
    assert reply.id.startswith("msg_")
    assert [b.type for b in reply.content] == ["text"]
    assert reply.content[0].text == "echo: hello big world"  # (the echo engine's words)
    assert reply.stop_reason == "end_turn" and reply.stop_sequence is None
    # FakeClient: words + 4 per message (system, user) + 2 for the generation prompt
    assert reply.usage.input_tokens == (2 + 4) + (3 + 4) + 2
    assert reply.usage.output_tokens == 4 and reply.usage.cache_read_input_tokens == 0
    [(_, messages, params)] = fake_server.state.client.requests
    assert messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello big\n\nworld"}]
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.5, 0.9, 40, 64)


def test_message_streamed_through_the_sdk(fake_server):
    with client(fake_server).messages.stream(model="fake-echo", max_tokens=64, messages=user("one two three")) as s:
        kinds = [event.type for event in s]
        final = s.get_final_message()
    assert final.content[0].text == "echo: one two three"
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 4 and final.usage.input_tokens == 9
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    events = raw_events(fake_server, {"model": "fake-echo", "max_tokens": 64, "messages": user("one two three")})
    check_sequence(events)
    start = events[0][1]["message"]
    assert start["usage"]["input_tokens"] == 9 and start["content"] == [] and start["stop_reason"] is None
    deltas = [d["delta"]["text"] for n, d in events if n == "content_block_delta"]
    assert "".join(deltas) == "echo: one two three" and len(deltas) == 4
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 4


def test_max_tokens_and_stop_sequences(fake_server):
    c = client(fake_server)
    cut = c.messages.create(model="fake-echo", max_tokens=2, messages=user("a b c d"))
    assert cut.content[0].text == "echo: a" and cut.stop_reason == "max_tokens"
    stopped = c.messages.create(model="fake-echo", max_tokens=50, messages=user("alpha beta gamma delta"),
                                stop_sequences=["zzz", "gam"])
    assert stopped.content[0].text == "echo: alpha beta "
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "gam"
    assert fake_server.state.client.requests[-1][2].stop == ["zzz", "gam"]
    events = raw_events(fake_server, {"model": "fake-echo", "max_tokens": 50, "messages": user("alpha beta gamma"),
                                      "stop_sequences": ["beta"]})
    check_sequence(events)
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "beta"}
    # an agent's max_tokens beyond the context is capped to it, not refused
    big = httpx.post(fake_server.url + "/v1/messages", json={"model": "fake-echo", "max_tokens": 10**6,
                                                              "messages": user("x")})
    assert big.json()["stop_reason"] == "end_turn" and fake_server.state.client.requests[-1][2].max_tokens == 2048


class CachedFakeClient(FakeClient):
    """Reports 5 of each prompt's tokens as served from the prefix cache."""

    def _start(self, words, prompt_tokens, params, sep=" "):
        base = super()._start(words, prompt_tokens, params, sep)

        class Cached(FakeStream):
            def __iter__(self):
                for d in super().__iter__():
                    if d.usage is not None:
                        d.usage.cached_tokens = 5
                    yield d

        return Cached(self, base.request_id, words, params, prompt_tokens, sep)


def test_cached_prompt_tokens_are_reported_apart():
    with running_server(CachedFakeClient()) as live:
        reply = client(live).messages.create(model="fake-echo", max_tokens=8, messages=user("a b c"))
        assert (reply.usage.input_tokens, reply.usage.cache_read_input_tokens) == (9 - 5, 5)
        events = raw_events(live, {"model": "fake-echo", "max_tokens": 8, "messages": user("a b c")})
        assert events[-2][1]["usage"]["cache_read_input_tokens"] == 5


# ---- tools --------------------------------------------------------------------------------------

@pytest.mark.parametrize("choice, grammar", [(None, False), ({"type": "auto"}, False), ({"type": "any"}, True),
                                             ({"type": "tool", "name": "get_weather"}, True)])
def test_a_tool_call_and_its_result_sent_back(fake_server, choice, grammar):
    c = client(fake_server)
    extra = {"tool_choice": choice} if choice else {}
    first = c.messages.create(model="fake-echo", max_tokens=64, tools=TOOLS, messages=user(CALL), **extra)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use"]
    use = first.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "unit": "c"} and use.id
    _, _, params = fake_server.state.client.requests[-1]
    assert [t["function"]["name"] for t in params.tools] == ["get_weather", "get_time"]
    assert params.tools[0]["function"]["parameters"] == WEATHER["input_schema"]
    assert (params.grammar is not None) == grammar  # any / tool force the call with a grammar
    history = user(CALL) + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 degrees"},
                                     {"type": "text", "text": "thanks"}]}]
    second = c.messages.create(model="fake-echo", max_tokens=64, tools=TOOLS, messages=history)
    assert second.stop_reason == "end_turn" and second.content[0].text == "echo: thanks"
    _, messages, _ = fake_server.state.client.requests[-1]
    assistant, result, last = messages[1:]
    assert assistant["role"] == "assistant" and assistant["content"] == "echo:"
    assert assistant["tool_calls"] == [{"id": use.id, "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "c"})}}]
    assert result == {"role": "tool", "content": "21 degrees", "tool_call_id": use.id, "name": "get_weather"}
    assert last == {"role": "user", "content": "thanks"}


def test_a_tool_call_streamed(fake_server):
    body = {"model": "fake-echo", "max_tokens": 64, "tools": TOOLS, "tool_choice": {"type": "any"},
            "messages": user(f"{CALL} done")}
    events = raw_events(fake_server, body)
    check_sequence(events)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"]
    assert starts[1]["name"] == "get_weather" and starts[1]["input"] == {}
    json_parts = [d["delta"]["partial_json"] for n, d in events
                  if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert json.loads("".join(json_parts)) == {"city": "Paris", "unit": "c"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with client(fake_server).messages.stream(**body) as s:  # the SDK puts the input back together
        final = s.get_final_message()
    assert final.content[-1].type == "tool_use" and final.content[-1].input == {"city": "Paris", "unit": "c"}
    assert final.stop_reason == "tool_use"


def test_tool_choice_none_leaves_the_tools_out(fake_server):
    reply = client(fake_server).messages.create(model="fake-echo", max_tokens=64, tools=TOOLS,
                                                tool_choice={"type": "none"}, messages=user(CALL))
    assert reply.stop_reason == "end_turn" and reply.content[0].text == f"echo: {CALL}"
    assert fake_server.state.client.requests[-1][2].tools is None


def test_thinking_blocks_are_accepted_and_sent_when_the_reasoning_is_separated(fake_server, monkeypatch):
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "greet back", "signature": "x"},
                                                 {"type": "redacted_thinking", "data": "abc"},
                                                 {"type": "text", "text": "hello"}]},
               {"role": "user", "content": "think then answer"}]
    reply = client(fake_server).messages.create(model="fake-echo", max_tokens=64, messages=history,
                                                thinking={"type": "enabled", "budget_tokens": 1024})
    assert reply.content[0].text == "echo: think then answer"
    assert fake_server.state.client.requests[-1][1][1] == {"role": "assistant", "content": "hello",
                                                          "reasoning_content": "greet back"}

    class FirstWordThinks:  # stands in for the server's reasoning separation
        def __init__(self):
            self.seen = False

        def feed(self, text):
            kind, self.seen = ("text" if self.seen else "thinking"), True
            return [(kind, text)]

        def finish(self):
            return []

    monkeypatch.setattr(anthropic_events, "reasoning_splitter", FirstWordThinks)
    body = {"model": "fake-echo", "max_tokens": 64, "messages": user("a b")}
    events = raw_events(fake_server, body)
    check_sequence(events)
    assert [d["content_block"]["type"] for n, d in events if n == "content_block_start"] == ["thinking", "text"]
    with client(fake_server).messages.stream(**body) as s:
        final = s.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == "echo:"
    assert final.content[1].text == " a b"


# ---- count_tokens -------------------------------------------------------------------------------

def test_count_tokens(fake_server):
    c = client(fake_server)
    count = c.messages.count_tokens(model="fake-echo", system="be brief", messages=user("one two three"))
    assert count.input_tokens == (2 + 4) + (3 + 4) + 2
    reply = c.messages.create(model="fake-echo", max_tokens=8, system="be brief", messages=user("one two three"))
    assert reply.usage.input_tokens == count.input_tokens
    with_tools = c.messages.count_tokens(model="fake-echo", messages=user("one two three"), tools=TOOLS)
    as_described = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                      "parameters": t["input_schema"]}} for t in TOOLS]
    assert with_tools.input_tokens == fake_server.state.client.count_chat_tokens(
        [{"role": "user", "content": "one two three"}], tools=as_described)
    assert with_tools.input_tokens > count.input_tokens + 20  # the tools count too


# ---- errors in Anthropic's shape ---------------------------------------------------------------

@pytest.mark.parametrize("messages, field, words", [
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "video", "url": "x"}]}],
     "messages.0.content.1.type", "content block type 'video' is not supported"),
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                 "data": "AAAA"}}]}],
     "messages.0.content.0.type", "image blocks are not supported"),
    ([{"role": "user", "content": [{"type": "document", "source": {}}]}],
     "messages.0.content.0.type", "document blocks are not supported"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}],
     "messages.2.content.0.tool_use_id", "no earlier tool_use block has the id 'toolu_nope'"),
    ([{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}],
     "messages.0.content.0.type", "'tool_use' is not supported in a user message"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": "x"}]}],
     "messages.0.content.0.input", "must be an object"),
    ([{"role": "user", "content": [{"text": "no type"}]}], "messages.0.content.0", "\"type\""),
    ([{"role": "tool", "content": "x"}], "messages.0.role", "Input should be"),
])
def test_bad_content_is_a_400_naming_the_block(fake_server, messages, field, words):
    with pytest.raises(anthropic.BadRequestError) as e:
        client(fake_server).messages.create(model="fake-echo", max_tokens=8, messages=messages)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    message = e.value.body["error"]["message"]
    assert message.startswith(field + ":") and words in message, message


@pytest.mark.parametrize("extra, field", [
    ({"tools": [{"name": "two words", "input_schema": {"type": "object"}}]}, "tools.0.name"),
    ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools.0.input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]}, "tools.0.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_time"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "objekt"}}}}],
      "tool_choice": {"type": "any"}}, "tools.0.input_schema"),
    ({"temperature": 1.5}, "temperature"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"system": [{"type": "image"}]}, "system.0.type"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_fields_are_a_400_naming_them(fake_server, extra, field):
    body = {"model": "fake-echo", "max_tokens": 8, "messages": user("hi"), **extra}
    r = httpx.post(fake_server.url + "/v1/messages", json=body)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(field), error


def test_missing_max_tokens_unknown_model_and_paths(fake_server):
    r = httpx.post(fake_server.url + "/v1/messages", json={"model": "fake-echo", "messages": user("hi")})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens: Field required")
    with pytest.raises(anthropic.NotFoundError) as e:
        client(fake_server).messages.create(model="claude-opus-4", max_tokens=8, messages=user("hi"))
    assert e.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": "model: the model 'claude-opus-4' does not exist; this server serves "
                                              "'fake-echo'"}}
    with pytest.raises(anthropic.NotFoundError):
        client(fake_server).messages.count_tokens(model="claude-opus-4", messages=user("hi"))
    r = httpx.post(fake_server.url + "/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(fake_server.url + "/v1/messages/nothing", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    too_long = client(fake_server)
    with pytest.raises(anthropic.BadRequestError, match="context"):
        too_long.messages.create(model="fake-echo", max_tokens=8, messages=user("w " * 3000))
    # the OpenAI routes keep OpenAI's shape
    with pytest.raises(openai.NotFoundError) as oe:
        openai_sdk(fake_server).chat.completions.create(model="claude-opus-4", messages=user("hi"))
    assert oe.value.body["code"] == "model_not_found"


def test_keys_by_x_api_key_or_bearer_and_anthropic_headers():
    with running_server(FakeClient(), ServerConfig(api_key="s3cret-key")) as live:
        with pytest.raises(anthropic.AuthenticationError) as e:
            client(live, api_key="wrong").messages.create(model="fake-echo", max_tokens=8, messages=user("hi"))
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
        assert "x-api-key" in e.value.body["error"]["message"]
        reply = client(live, api_key="s3cret-key").messages.create(model="fake-echo", max_tokens=8,
                                                                   messages=user("ok"))
        assert reply.content[0].text == "echo: ok"
        bearer = anthropic.Anthropic(base_url=live.url, auth_token="s3cret-key", max_retries=0)
        assert bearer.messages.count_tokens(model="fake-echo", messages=user("ok")).input_tokens == 7
        # the key by x-api-key works on the OpenAI routes too; a missing one gets OpenAI's shape there
        assert httpx.get(live.url + "/v1/models", headers={"x-api-key": "s3cret-key"}).status_code == 200
        assert httpx.get(live.url + "/v1/models").json()["error"]["code"] == "invalid_api_key"
        events = raw_events(live, {"model": "fake-echo", "max_tokens": 8, "messages": user("ok")},
                            headers={"x-api-key": "s3cret-key", "anthropic-version": "2023-06-01",
                                     "anthropic-beta": "interleaved-thinking-2025-05-14"})
        check_sequence(events)


def test_a_big_body_and_a_draining_server_get_anthropic_errors():
    with running_server(FakeClient(), ServerConfig(max_body_bytes=1000)) as live:
        r = httpx.post(live.url + "/v1/messages", json={"model": "fake-echo", "max_tokens": 8,
                                                        "messages": user("x" * 2000)})
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
        live.state.draining = True
        with pytest.raises(anthropic.APIStatusError) as e:
            client(live).messages.create(model="fake-echo", max_tokens=8, messages=user("hi"))
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"]
        assert e.value.body["error"] == {"type": "overloaded_error", "message": "the server is shutting down"}


class FailingClient(FakeClient):
    """Fails every generation after its first word, as an engine step failure does."""

    def _start(self, words, prompt_tokens, params, sep=" "):
        base = super()._start(words, prompt_tokens, params, sep)

        class Failing(FakeStream):
            def __iter__(self):
                yield TextDelta(text="echo:")
                yield TextDelta(finish_reason="error", error="engine error: step failed")

        return Failing(self, base.request_id, words, params, prompt_tokens, sep)


def test_an_engine_failure_is_an_api_error_whole_or_streamed():
    with running_server(FailingClient()) as live:
        with pytest.raises(anthropic.InternalServerError) as e:
            client(live).messages.create(model="fake-echo", max_tokens=8, messages=user("hi"))
        assert e.value.body["error"] == {"type": "api_error", "message": "engine error: step failed"}
        with pytest.raises(anthropic.APIStatusError, match="step failed"):
            with client(live).messages.stream(model="fake-echo", max_tokens=8, messages=user("hi")) as s:
                list(s)


# ---- a forced call on the tiny random model -------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_server():
    cfg = random_config("tiny")
    model = build_model(cfg, random_tensors(cfg), torch.device("cpu"), torch.bfloat16)
    loaded = LoadedModel("tiny-tools", "", cfg, model, small_bpe_tokenizer(), ChatTemplate(QWEN25, "", ""),
                         "random bf16", 0.0)
    local = LocalClient(loaded, EngineConfig(max_model_len=2048))
    with running_server(local) as live:
        yield live
    local.close()


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_forced_tool_round_trip_on_the_tiny_model(tiny_server, streaming):
    c = client(tiny_server)
    args = dict(model="tiny-tools", max_tokens=300, extra_body={"temperature": 0}, tools=TOOLS,
                tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    messages = user("What is the weather in Paris?")
    if streaming:
        with c.messages.stream(messages=messages, **args) as s:
            first = s.get_final_message()
    else:
        first = c.messages.create(messages=messages, **args)
    assert first.stop_reason == "tool_use", first
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    history = messages + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True, exclude={"parsed_output"})
                                          for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 degrees"}]}]
    second = c.messages.create(model="tiny-tools", messages=history, tools=TOOLS, tool_choice={"type": "none"},
                               max_tokens=12, extra_body={"temperature": 0})
    assert second.stop_reason in ("end_turn", "max_tokens") and second.usage.output_tokens > 0
    def prompt(usage):
        return usage.input_tokens + usage.cache_read_input_tokens

    assert prompt(first.usage) == c.messages.count_tokens(model="tiny-tools", messages=messages,
                                                          tools=TOOLS).input_tokens
    assert prompt(second.usage) == c.messages.count_tokens(model="tiny-tools", messages=history, tools=TOOLS,
                                                           tool_choice={"type": "none"}).input_tokens
    assert second.usage.cache_read_input_tokens > 0  # the conversation's start came from the prefix cache


def test_the_keep_alive_is_a_ping_event():
    with running_server(FakeClient(token_delay=0.1), ServerConfig(sse_ping_s=0.05)) as live:
        events = raw_events(live, {"model": "fake-echo", "max_tokens": 8, "messages": user("a b c")})
        check_sequence(events)
        assert [n for n, _ in events].count("ping") >= 3  # the first, then keep-alives while words come
        with client(live).messages.stream(model="fake-echo", max_tokens=8, messages=user("a b c")) as s:
            assert s.get_final_message().content[0].text == "echo: a b c"
