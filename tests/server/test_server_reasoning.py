"""Reasoning kept apart on /v1/chat/completions: `reasoning_content` in the message and in stream
deltas (Qwen3 <think>, a prompt that opened it, gpt-oss harmony with a tool call), kept inline by
`reasoning_format: none` or the server's --reasoning-format, `chat_template_kwargs` passed to the
template (and refused with a 400 naming it when it would replace the server's variables)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from server_helpers import running_server

from exlcli.client.fake import FakeClient
from exlcli.client.local import LocalClient
from exlcli.engine.engine import EngineConfig
from exlcli.model.architectures import build_model
from exlcli.model.loader import LoadedModel
from exlcli.model.random_weights import random_config, random_tensors
from exlcli.server.app import ServerConfig
from exlcli.text.chat_template import ChatTemplate
from tests.text.marker_tokenizers import marker_tokenizer
from tests.text.tool_templates import QWEN3, QWEN3_THINKING, WEATHER_TOOL


class ThinkingFake(FakeClient):
    """Answers with the last user message itself (word by word: the tags come in deltas of their
    own or with text), as a model of `syntax` would write it."""

    def __init__(self, syntax: str, opened: bool = False) -> None:
        super().__init__(token_delay=0.0)
        self.syntax, self.opened = syntax, opened

    def reasoning_syntax(self):
        return self.syntax

    def chat(self, messages, params):
        self.requests.append(("chat", [dict(m) for m in messages], params))
        stream = self._start(messages[-1]["content"].split(" "), 4, params)
        stream.reasoning_open = self.opened
        return stream


def post(live, body: dict) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/chat/completions", json={"model": "fake-echo", **body}, timeout=30)


def ask(text: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], **extra}


def streamed(live, body: dict) -> tuple[str, str, list[dict]]:
    reply = post(live, {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    return ("".join(d.get("reasoning_content") or "" for d in deltas),
            "".join(d.get("content") or "" for d in deltas), deltas)


THOUGHT = "<think>\nI should greet back.\n</think>\n\nHello there!"


def test_reasoning_content_apart_whole_and_streamed():
    with running_server(ThinkingFake("think")) as live:
        message = post(live, ask(THOUGHT)).json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "Hello there!",
                           "reasoning_content": "I should greet back.\n"}
        reasoning, content, deltas = streamed(live, ask(THOUGHT))
        assert (reasoning, content) == ("I should greet back.\n", "Hello there!")
        first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
        assert all(not d.get("reasoning_content") for d in deltas[first_content:])  # reasoning first


def test_a_prompt_that_opened_think_starts_inside_it():
    with running_server(ThinkingFake("think", opened=True)) as live:
        message = post(live, ask("I ponder.</think> Answer.")).json()["choices"][0]["message"]
        assert message["reasoning_content"] == "I ponder." and message["content"] == "Answer."


def test_no_reasoning_means_no_field():
    with running_server(ThinkingFake("think")) as live:
        message = post(live, ask("Just an answer.")).json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "Just an answer."}


def test_reasoning_format_none_keeps_it_inline():
    with running_server(ThinkingFake("think")) as live:
        message = post(live, ask(THOUGHT, reasoning_format="none")).json()["choices"][0]["message"]
        assert message["content"] == THOUGHT and "reasoning_content" not in message
    with running_server(ThinkingFake("think"), ServerConfig(reasoning_format="none")) as live:
        assert post(live, ask(THOUGHT)).json()["choices"][0]["message"]["content"] == THOUGHT
        reasoning, content, _ = streamed(live, ask(THOUGHT))
        assert reasoning == "" and content == THOUGHT
        # a request may still ask for it apart
        message = post(live, ask(THOUGHT, reasoning_format="auto")).json()["choices"][0]["message"]
        assert message["reasoning_content"] == "I should greet back.\n"


HARMONY_CALL = ("<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>"
                "commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city":"Paris","unit":"c"}')


@pytest.mark.parametrize("stream", [False, True])
def test_harmony_reasoning_and_a_tool_call(stream):
    client = ThinkingFake("harmony")
    client.tool_format_name = "harmony"
    with running_server(client) as live:
        body = ask(HARMONY_CALL, tools=[WEATHER_TOOL])
        if not stream:
            choice = post(live, body).json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls"
            message = choice["message"]
            assert message["reasoning_content"] == "The user wants the weather." and message["content"] is None
            [call] = message["tool_calls"]
        else:
            reasoning, content, deltas = streamed(live, body)
            assert reasoning == "The user wants the weather." and content == ""
            calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
            call = {"function": {"name": calls[0]["function"]["name"],
                                 "arguments": "".join(tc["function"].get("arguments") or "" for tc in calls)}}
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "c"}


def test_chat_template_kwargs_reach_the_template_and_bad_ones_are_a_400():
    client = ThinkingFake("think")
    with running_server(client) as live:
        assert post(live, ask("hi", chat_template_kwargs={"enable_thinking": False})).status_code == 200
        assert client.requests[-1][2].chat_template_kwargs == {"enable_thinking": False}
        for bad, words in (({"messages": []}, "set by the server"), ({"not a name": 1}, "not a template variable"),
                           ([1], "dict")):
            reply = post(live, ask("hi", chat_template_kwargs=bad))
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"].startswith("chat_template_kwargs") and words in error["message"], error


# ---- the template side, on the tiny random model ------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model():
    cfg = random_config("tiny")
    return cfg, build_model(cfg, random_tensors(cfg), torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("template, kwargs, opened", [
    (QWEN3, None, False), (QWEN3_THINKING, None, True), (QWEN3, {"enable_thinking": False}, False)])
def test_the_prompt_decides_whether_the_answer_starts_thinking(tiny_model, template, kwargs, opened):
    cfg, model = tiny_model
    tokenizer = marker_tokenizer("user", chat_template=template)
    loaded = LoadedModel("tiny-think", "", cfg, model, tokenizer, ChatTemplate(template, "", ""), "random", 0.0)
    client = LocalClient(loaded, EngineConfig(max_model_len=512, kv_memory=32 * 2**20))
    try:
        from exlcli.client.base import GenerationParams

        ids = client.chat_prompt_ids([{"role": "user", "content": "hi"}], template_kwargs=kwargs)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        assert text.endswith("</think>\n\n") == (kwargs is not None)
        stream = client.chat([{"role": "user", "content": "hi"}],
                             GenerationParams(max_tokens=2, chat_template_kwargs=kwargs))
        stream.collect()
        assert client.reasoning_syntax() == "think" and stream.reasoning_open is opened
    finally:
        client.close()
