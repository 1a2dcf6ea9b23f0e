"""context_overflow / sink_tokens / window on chat and completions: carried to the engine's
GenerationParams, bad values a 400 naming the field; usage reports evicted_tokens."""

import openai
import pytest
from test_server_openai_sdk import sdk

from exlcli.client.base import Usage
from exlcli.server.openai_format import usage_dict
from exlcli.server.schemas import ChatCompletionRequest, CompletionRequest


def test_the_fields_reach_the_generation_params():
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], context_overflow="sinks",
                                 sink_tokens=0, window=256)
    p = chat.generation_params(0, 16)
    assert (p.context_overflow, p.sink_tokens, p.window) == ("sinks", 0, 256)
    plain = CompletionRequest(prompt="x").generation_params(0, 16)
    assert (plain.context_overflow, plain.sink_tokens, plain.window) == (None, None, None)


@pytest.mark.parametrize("field,value", [("context_overflow", "wrap"), ("sink_tokens", -1), ("window", 0)])
def test_bad_values_are_400_naming_the_field(fake_server, field, value):
    client = sdk(fake_server)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-echo", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={field: value})
    assert field in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake-echo", prompt="hi", extra_body={field: value})
    assert field in str(e.value)


def test_usage_reports_the_evicted_tokens():
    body = usage_dict([(0, Usage(prompt_tokens=3, completion_tokens=900, evicted_tokens=512)),
                       (0, Usage(prompt_tokens=3, completion_tokens=10))])
    assert body["evicted_tokens"] == 512 and body["completion_tokens"] == 910


def test_a_session_reaches_the_first_choice_only():
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], session="conv-1", n=2)
    assert chat.generation_params(0, 16).session == "conv-1" and chat.generation_params(1, 16).session is None
    assert CompletionRequest(prompt="x").generation_params(0, 16).session is None


def test_an_empty_session_is_a_400_naming_it(fake_server):
    with pytest.raises(openai.BadRequestError) as e:
        sdk(fake_server).chat.completions.create(model="fake-echo", messages=[{"role": "user", "content": "hi"}],
                                                 extra_body={"session": ""})
    assert "session" in str(e.value)
