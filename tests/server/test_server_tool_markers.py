"""Forced and named tool calls on tokenizers whose tool tags are tokens of their own (issue #51's
defect: a Qwen2.5 GGUF's user-defined <tool_call> made every forced call a 500, "the grammar does
not allow token ..."), for every tool format, on the tiny random model behind the real server."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from server_helpers import running_server
from test_server_openai_sdk import sdk

from exlcli.client.local import LocalClient
from exlcli.engine.engine import EngineConfig
from exlcli.model.architectures import build_model
from exlcli.model.loader import LoadedModel
from exlcli.model.random_weights import random_config, random_tensors
from exlcli.text.chat_template import ChatTemplate
from tests.text.marker_tokenizers import HARMONY_TAGS, TOOL_TAGS, marker_tokenizer
from tests.text.tool_templates import (
    GLM45,
    GPT_OSS,
    LLAMA31,
    MISTRAL_V03,
    QWEN3_CODER,
    QWEN25,
    TIME_TOOL,
    WEATHER_TOOL,
)

TOOLS = [WEATHER_TOOL, TIME_TOOL]
KV_MEMORY = 32 * 2**20  # a small pool: a test here starts 20 engines, and a default one takes 1 GiB
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TEMPLATES = {"hermes": QWEN25, "llama3_json": LLAMA31, "mistral": MISTRAL_V03, "qwen3_coder": QWEN3_CODER,
             "glm45": GLM45, "harmony": GPT_OSS}


@pytest.fixture(scope="module")
def tiny_model():
    cfg = random_config("tiny")
    return cfg, build_model(cfg, random_tensors(cfg), torch.device("cpu"), torch.bfloat16)


def serve(tiny_model, template: str, kind: str):
    cfg, model = tiny_model
    tags = TOOL_TAGS + HARMONY_TAGS if "<|channel|>" in template else TOOL_TAGS
    tokenizer = marker_tokenizer(kind, tags, template)
    loaded = LoadedModel("tiny-tags", "", cfg, model, tokenizer, ChatTemplate(template, "", ""), "random bf16", 0.0)
    client = LocalClient(loaded, EngineConfig(max_model_len=2048, kv_memory=KV_MEMORY))
    return client, running_server(client)


@pytest.mark.parametrize("kind", ["special", "user", "text"])
@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_forced_and_named_calls_on_tag_tokens(tiny_model, fmt, kind):
    client, server = serve(tiny_model, TEMPLATES[fmt], kind)
    try:
        with server as live:
            assert client.tool_format().name == fmt
            api = sdk(live)
            ask = [{"role": "user", "content": "weather?"}]
            for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
                reply = api.chat.completions.create(model="tiny-tags", messages=ask, tools=TOOLS, tool_choice=choice,
                                                    parallel_tool_calls=False, temperature=0, max_tokens=200)
                message = reply.choices[0].message
                assert reply.choices[0].finish_reason == "tool_calls", (fmt, kind, message)
                assert len(message.tool_calls) == 1
                call = message.tool_calls[0].function
                assert choice == "required" or call.name == "get_time"
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    finally:
        client.close()


def test_a_grammar_the_tokenizer_disagrees_with_is_a_400_not_a_500(tiny_model):
    """A request's own grammar that spells a user-defined token as text: the grammar library's
    mask allows the token and its matcher then refuses it. The answer names the token, without the
    library's state dump, as the request's problem."""
    import httpx

    client, server = serve(tiny_model, QWEN25, "user")
    body = {"model": "tiny-tags", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
            "response_format": {"type": "grammar", "grammar": 'start: "<tool_call>" "x"'}}
    try:
        with server as live:
            reply = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["code"] == "grammar_mismatch" and error["type"] == "invalid_request_error"
            assert "token 390" in error["message"] and "<state>" not in error["message"]
            streamed = httpx.post(f"{live.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
            events = [json.loads(line[6:]) for line in streamed.text.splitlines()
                      if line.startswith("data: {")]
            assert events[-1]["error"]["code"] == "grammar_mismatch"
            # the engine is fine: the next request runs
            ok = httpx.post(f"{live.url}/v1/chat/completions", json={**body, "response_format": None}, timeout=60)
            assert ok.status_code == 200
    finally:
        client.close()


def test_tool_format_named_over_the_templates(tiny_model):
    client, _ = serve(tiny_model, QWEN3_CODER, "user")
    try:
        assert client.tool_format().name == "qwen3_coder"
        client.tool_format_name = "hermes"  # exlcli serve --tool-format hermes
        assert client.tool_format().name == "hermes"
    finally:
        client.close()
