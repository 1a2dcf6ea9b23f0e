"""The Responses API (/v1/responses) through the official openai SDK against a real uvicorn: on the
echo engine (shapes, streams whose every event validates against the SDK's own types, tool calls
and their outputs, storage, GET/DELETE, errors naming the field), and on the tiny random model
(a forced call and its output sent back through previous_response_id, each next turn resuming
the engine's cached pages)."""

from __future__ import annotations

import io
import json

import httpx
import jsonschema
import openai
import pytest
import torch
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from server_helpers import running_server
from test_server_openai_sdk import sdk

from exlcli.client.base import TextDelta
from exlcli.client.fake import FakeClient, FakeStream
from exlcli.client.local import LocalClient
from exlcli.engine.engine import EngineConfig
from exlcli.model.architectures import build_model
from exlcli.model.loader import LoadedModel
from exlcli.model.random_weights import random_config, random_tensors
from exlcli.server.app import ServerConfig
from exlcli.text.chat_template import ChatTemplate
from tests.engine.grammar_helpers import small_bpe_tokenizer
from tests.text.tool_templates import QWEN25, WEATHER_TOOL

EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses shape: no nested "function"
CALL = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}</tool_call>'


def raw_events(url: str, body: dict) -> list[dict]:
    """The stream as sent: each event's name must be its JSON's type, and each must validate."""
    events = []
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                payload = json.loads(line[len("data: "):])
                assert payload["type"] == name
                EVENTS.validate_python(payload)  # strict: pydantic validation, not the SDK's lenient construct
                events.append(payload)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


# ---- the echo engine --------------------------------------------------------------------------

def test_text_input_whole(fake_server):
    client = sdk(fake_server)
    raw = client.responses.with_raw_response.create(model="fake-echo", input="hello big world",
                                                    instructions="be brief", metadata={"job": "7"},
                                                    max_output_tokens=50, temperature=0.5, top_p=0.9)
    reply = Response.model_validate(json.loads(raw.text))  # every field as the SDK types it
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.status == "completed"
    assert reply.output_text == "echo: hello big world"
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert reply.instructions == "be brief" and reply.metadata == {"job": "7"} and reply.max_output_tokens == 50
    assert (reply.temperature, reply.top_p) == (0.5, 0.9)
    # FakeClient: words + 4 per message + 2 for the generation prompt; instructions are the system message
    assert reply.usage.input_tokens == (2 + 4) + (3 + 4) + 2
    assert reply.usage.output_tokens == 4 and reply.usage.total_tokens == 19
    _, messages, params = fake_server.state.client.requests[-1]
    assert messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello big world"}]
    assert (params.max_tokens, params.temperature, params.top_p) == (50, 0.5, 0.9)


def test_item_input_becomes_chat_messages(fake_server):
    reply = sdk(fake_server).responses.create(model="fake-echo", input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "weather "},
                                     {"type": "input_text", "text": "now?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "checking"}]},
        {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"},
        {"type": "function_call_output", "call_id": "call_9", "output": "rain"},
        {"role": "user", "content": "thanks"}], instructions="be brief")
    assert reply.output_text == "echo: thanks"
    _, messages, _ = fake_server.state.client.requests[-1]
    assert messages == [
        {"role": "system", "content": "be brief\n\nrules"},  # instructions and leading system turns, as one
        {"role": "user", "content": "weather now?"},
        {"role": "assistant", "content": "checking", "tool_calls": [
            {"id": "call_9", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
        {"role": "tool", "content": "rain", "tool_call_id": "call_9"},
        {"role": "user", "content": "thanks"}]


def test_streamed_text_through_the_sdk_stream(fake_server):
    client = sdk(fake_server)
    with client.responses.stream(model="fake-echo", input="one two three") as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 4, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "echo: one two three"
    assert final.output_text == "echo: one two three" and final.usage.output_tokens == 4
    # create(stream=True): the same events, typed
    typed = list(client.responses.create(model="fake-echo", input="one two three", stream=True))
    assert [e.type for e in typed] == [e.type for e in events]
    assert typed[-1].response.status == "completed" and typed[-1].response.id.startswith("resp_")
    raw = raw_events(fake_server.url, {"model": "fake-echo", "input": "one two three"})
    assert raw[-1]["response"]["output"][0]["content"][0]["text"] == "echo: one two three"


def test_streamed_answer_that_runs_out_of_tokens_is_incomplete(fake_server):
    events = raw_events(fake_server.url, {"model": "fake-echo", "input": "a b c d e", "max_output_tokens": 2})
    last = events[-1]
    assert last["type"] == "response.incomplete" and last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    whole = sdk(fake_server).responses.create(model="fake-echo", input="a b c d e", max_output_tokens=2)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text == "echo: a"


def test_calls_become_function_call_items_and_their_output_goes_back(fake_server):
    client = sdk(fake_server)
    first = client.responses.create(model="fake-echo", input=f"{CALL} done", tools=[WEATHER])
    [message, call] = first.output
    assert message.type == "message" and message.content[0].text == "echo:  done"
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and json.loads(call.arguments) == {"city": "Paris", "unit": "c"}
    second = client.responses.create(model="fake-echo", previous_response_id=first.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "{\"temp\": 21}"}])
    assert second.previous_response_id == first.id and second.output_text == "echo:  done"  # the same user turn
    _, messages, _ = fake_server.state.client.requests[-1]
    assert messages[1] == {"role": "assistant", "content": "echo:  done", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]}
    assert messages[2] == {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": call.call_id}


def test_streamed_calls(fake_server):
    events = raw_events(fake_server.url, {"model": "fake-echo", "input": f"{CALL} {CALL.replace('Paris', 'Rome')}",
                                          "tools": [WEATHER], "tool_choice": "auto"})
    kinds = [e["type"] for e in events]
    assert kinds.count("response.function_call_arguments.done") == 2
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [d["type"] for d in done] == ["message", "function_call", "function_call"]
    assert [json.loads(d["arguments"])["city"] for d in done[1:]] == ["Paris", "Rome"]
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert [d["item_id"] for d in deltas] == [d["id"] for d in done[1:]]
    final = events[-1]["response"]
    assert final["status"] == "completed" and [o["type"] for o in final["output"]] == [
        "message", "function_call", "function_call"]


def test_required_tool_choice_and_text_format_reach_the_engine(fake_server):
    client = sdk(fake_server)
    client.responses.create(model="fake-echo", input="x", tools=[WEATHER], tool_choice="required")
    _, _, params = fake_server.state.client.requests[-1]
    assert params.tools[0]["function"]["name"] == "get_weather" and params.grammar.kind == "grammar"
    client.responses.create(model="fake-echo", input="x", text={"format": {
        "type": "json_schema", "name": "point", "schema": {"type": "object", "properties": {"x": {"type": "number"}}},
        "strict": True}})
    _, _, params = fake_server.state.client.requests[-1]
    assert params.grammar.kind == "json_schema" and params.grammar.strict and params.tools is None
    client.responses.create(model="fake-echo", input="x", tools=[WEATHER], tool_choice="none")
    _, _, params = fake_server.state.client.requests[-1]
    assert params.tools is None and params.grammar is None


def test_stored_responses_get_delete_and_continue(fake_server):
    client = sdk(fake_server)
    first = client.responses.create(model="fake-echo", input="remember me")
    assert first.store is True
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == "echo: remember me"
    second = client.responses.create(model="fake-echo", input="and this", previous_response_id=first.id,
                                     instructions="new rules")
    _, messages, params = fake_server.state.client.requests[-1]
    assert [m["content"] for m in messages] == ["new rules", "remember me", "echo: remember me", "and this"]
    session = params.session
    assert session  # the conversation's engine session, the same each turn
    client.responses.create(model="fake-echo", input="third", previous_response_id=second.id)
    assert fake_server.state.client.requests[-1][2].session == session
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(first.id)
    assert e.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="fake-echo", input="x", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    assert client.responses.retrieve(second.id).id == second.id  # a later turn keeps its own history


def test_store_false_keeps_nothing(fake_server):
    client = sdk(fake_server)
    reply = client.responses.create(model="fake-echo", input="forget me", store=False)
    assert reply.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(reply.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model="fake-echo", input="x", previous_response_id=reply.id)
    assert fake_server.state.client.requests[-1][2].session is None  # no cache parked for a next turn either
    streamed = list(client.responses.create(model="fake-echo", input="forget me", store=False, stream=True))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(streamed[-1].response.id)


def test_prompt_cache_key_names_the_session(fake_server):
    sdk(fake_server).responses.create(model="fake-echo", input="x", store=False, prompt_cache_key="conv-1")
    assert fake_server.state.client.requests[-1][2].session == "resp:conv-1"


def test_the_store_is_bounded_least_recently_used_first():
    with running_server(FakeClient(), ServerConfig(max_stored_responses=2)) as live:
        client = sdk(live)
        a, b = (client.responses.create(model="fake-echo", input=t) for t in ("a", "b"))
        client.responses.retrieve(a.id)  # a is now the more recently used
        client.responses.create(model="fake-echo", input="c")
        assert client.responses.retrieve(a.id).id == a.id
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(b.id)


@pytest.mark.parametrize("body, status, param, words", [
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, 400, "input.0.type", "unknown input item type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400,
     "input.0.content.0.type", "'input_image' is not supported"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400, "input.0.call_id",
     "no function call with call_id 'call_x'"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "two words", "arguments": "{}"}]}, 400,
     "input.0.name", "pattern"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 400, "previous_response_id", "not found"),
    ({"input": "x", "model": "gpt-9"}, 404, "model", "does not exist"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, 400,
     "tools.0.parameters", "type \"object\""),
    ({"input": "x", "tools": [{"type": "function", "name": "f",
                               "parameters": {"properties": {"a": {"type": "objekt"}}}}]}, 400,
     "tools.0.parameters", "invalid JSON schema"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}}, 400,
     "tool_choice", "'get_time' is not among the tools"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, 400, "tool_choice", "not supported"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, 400, "text.format", "schema"),
    ({"input": "x", "max_output_tokens": 10**6}, 400, "max_output_tokens", "context"),
    ({"input": "x", "temperature": 5}, 400, "temperature", ""),
    ({"input": "x", "background": True}, 400, "background", "not supported"),
    ({}, 400, "input", "required"),
    ({"input": []}, 400, "input", "1 to"),
    ({"input": "w " * 3000}, 400, "input", "longer than the model's context"),
])
def test_bad_input_is_an_openai_error_naming_the_field(fake_server, body, status, param, words):
    r = httpx.post(fake_server.url + "/v1/responses", json={"model": "fake-echo", **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_hosted_tools_are_accepted_and_not_offered(fake_server):
    reply = sdk(fake_server).responses.create(model="fake-echo", input="x", tools=[
        WEATHER, {"type": "web_search"}, {"type": "namespace", "name": "ns", "tools": []}])
    assert reply.status == "completed" and [t.name for t in reply.tools] == ["get_weather"]
    _, _, params = fake_server.state.client.requests[-1]
    assert [t["function"]["name"] for t in params.tools] == ["get_weather"]


def test_reasoning_comes_as_reasoning_items(fake_server, monkeypatch):
    # a thinking model whose prompt opened "<think>": the answer is reasoning until "</think>"
    monkeypatch.setattr(type(fake_server.state.client), "reasoning_syntax", lambda self: "think", raising=False)
    monkeypatch.setattr(FakeStream, "reasoning_open", True, raising=False)
    body = {"model": "fake-echo", "input": "a</think> b"}
    events = raw_events(fake_server.url, body)
    kinds = [e["type"] for e in events]
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"][0]["text"].strip() == "echo: a"
    assert items[1]["content"][0]["text"].strip() == "b"
    whole = sdk(fake_server).responses.create(**body)
    assert [o.type for o in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text.strip() == "echo: a" and whole.output_text.strip() == "b"


class _FailingStream(FakeStream):
    def __iter__(self):
        yield TextDelta(text="half")
        yield TextDelta(finish_reason="error", error="engine error: boom")


class _FailingClient(FakeClient):
    def _start(self, words, prompt_tokens, params):
        stream = super()._start(words, prompt_tokens, params)
        stream.__class__ = _FailingStream
        return stream


def test_an_engine_failure_fails_the_response_and_stores_nothing():
    with running_server(_FailingClient()) as live:
        events = raw_events(live.url, {"model": "fake-echo", "input": "q"})
        last = events[-1]
        assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
        assert last["response"]["error"] == {"code": "server_error", "message": "engine error: boom"}
        assert last["response"]["output"][0]["status"] == "incomplete"
        with pytest.raises(openai.InternalServerError, match="boom"):
            sdk(live).responses.create(model="fake-echo", input="q")
        with pytest.raises(openai.NotFoundError):
            sdk(live).responses.retrieve(last["response"]["id"])


# ---- the tiny random model: forced calls, outputs sent back, cached pages resumed ----------------

@pytest.fixture(scope="module")
def tiny_server():
    cfg = random_config("tiny")
    model = build_model(cfg, random_tensors(cfg), torch.device("cpu"), torch.bfloat16)
    loaded = LoadedModel("tiny-responses", "", cfg, model, small_bpe_tokenizer(), ChatTemplate(QWEN25, "", ""),
                         "random bf16", 0.0)
    client = LocalClient(loaded, EngineConfig(max_model_len=2048))
    with running_server(client) as live:
        yield live
    client.close()


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_required_call_and_its_output_resume_the_cached_conversation(tiny_server, streaming):
    client = sdk(tiny_server)
    engine = tiny_server.state.client.engine
    args = dict(model="tiny-responses", tools=[WEATHER], temperature=0, max_output_tokens=200)
    if streaming:
        with client.responses.stream(input="What is the weather in Paris?", tool_choice="required",
                                     parallel_tool_calls=False, **args) as stream:
            kinds = [e.type for e in stream]
            first = stream.get_final_response()
        assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    else:
        first = client.responses.create(input="What is the weather in Paris?", tool_choice="required",
                                        parallel_tool_calls=False, **args)
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    resumed_before = engine.sessions.num_resumed
    # the same tools in the prompt (tool_choice "none" would leave them out, and the prompt would
    # differ from its first token on)
    second = client.responses.create(previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "{\"temp\": 21}"}], **args)
    assert second.status in ("completed", "incomplete") and second.usage.output_tokens > 0
    # the first turn's prompt and answer come from the engine's parked pages, not computed again
    # (down to a page boundary where the pages are shared with the prefix cache)
    assert engine.sessions.num_resumed == resumed_before + 1
    page = engine.pool.page_size
    cached = second.usage.input_tokens_details.cached_tokens
    assert first.usage.input_tokens // page * page <= cached < second.usage.input_tokens
    third = client.responses.create(previous_response_id=second.id, input="And tomorrow?", **args)
    assert engine.sessions.num_resumed == resumed_before + 2
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens // page * page


def test_a_conversation_sent_whole_resumes_by_its_prompt_cache_key(tiny_server):
    """As Codex sends it: store false, the whole conversation each turn, one prompt_cache_key."""
    client = sdk(tiny_server)
    engine = tiny_server.state.client.engine
    args = dict(model="tiny-responses", temperature=0, max_output_tokens=6, store=False, prompt_cache_key="conv-7")
    turn = [{"role": "user", "content": "Tell me about the sea."}]
    first = client.responses.create(input=turn, **args)
    resumed_before = engine.sessions.num_resumed
    turn += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And rivers?"}]
    second = client.responses.create(input=turn, **args)
    assert engine.sessions.num_resumed == resumed_before + 1
    page = engine.pool.page_size
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // page * page > 0


# ---- the default model ----------------------------------------------------------------------------

@pytest.mark.slow
def test_default_model_conversation_resumes_from_the_cache(default_model_path):
    client = LocalClient.from_model(default_model_path, log=io.StringIO())
    try:
        with running_server(client) as live:
            api = sdk(live)
            args = dict(model=client.model_name, instructions="Answer in one sentence.", temperature=0,
                        max_output_tokens=30)
            first = api.responses.create(input="What is the capital of France?", **args)
            assert "Paris" in first.output_text and first.usage.input_tokens_details.cached_tokens == 0
            with api.responses.stream(input="And of Italy?", previous_response_id=first.id, **args) as stream:
                second = stream.get_final_response()
            assert "Rome" in second.output_text
            # the whole first turn (prompt and answer) comes from the pages it left
            cached = second.usage.input_tokens_details.cached_tokens
            assert first.usage.input_tokens < cached < second.usage.input_tokens
    finally:
        client.close()
