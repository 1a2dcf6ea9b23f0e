"""Every front end speaks the one vocabulary of generation parameters (exlcli.engine.sampling): for
each declared parameter, the server's JSON schema carries its bounds, and the server's bodies, the
chat's /set and batch lines accept exactly the values its rule accepts (the server within OpenAI's
narrower range where the API has one), and the remote client sends each under its own name."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from exlcli.batch.lines import NATIVE, OPENAI, BadLine, Job, LineDefaults, parse_line
from exlcli.chat.settings import CHAT_DEFAULTS, CHAT_NAMES, SETTINGS, ChatSettings, SettingError, apply_setting
from exlcli.client.base import GenerationParams
from exlcli.client.remote import RemoteClient
from exlcli.engine.sampling import (
    API_PARAMS,
    COUNT,
    INT64_MAX,
    INT64_MIN,
    MAX_TOKENS,
    NUMBER,
    PARAMS,
    SAMPLING_PARAMS,
    Param,
    ParamError,
)
from exlcli.server.schemas import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def probes(param: Param) -> list:
    """Values on, just inside and just outside every bound the parameter has, and far ones."""
    edges = {b for b in (param.low, param.high, param.api_low, param.api_high, param.default, 0) if b is not None}
    if param.kind == NUMBER:
        return sorted({float(e) + d for e in edges for d in (-1e-3, 0.0, 1e-3)} | {-1e6, 1e6})
    return sorted({int(e) + d for e in edges for d in (-1, 0, 1)} | {INT64_MIN - 1, INT64_MIN, INT64_MAX,
                                                                    INT64_MAX + 1})


def rule_accepts(param: Param, value) -> ParamError | None:
    try:
        param.check(value)
    except ParamError as e:
        return e
    return None


def api_accepts(param: Param, value) -> bool:
    return (rule_accepts(param, value) is None
            and (param.api_low is None or value >= param.api_low)
            and (param.api_high is None or value <= param.api_high))


def cases(params) -> list:
    return [pytest.param(p, v, id=f"{p.name}={v!r}") for p in params for v in probes(p)]


def test_the_server_schema_carries_each_parameters_bounds_and_doc():
    for model, extra in ((ChatCompletionRequest, {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"}),
                         (CompletionRequest, {"logprobs": "logprobs"})):
        properties = model.model_json_schema()["properties"]
        fields = {p.name: p.name for p in API_PARAMS} | extra
        for field, name in fields.items():
            param = PARAMS[name]
            (schema,) = [b for b in properties[field]["anyOf"] if b["type"] != "null"]
            assert schema["type"] == ("number" if param.kind == NUMBER else "integer"), field
            low = param.api_low if param.api_low is not None else param.low
            high = param.api_high if param.api_high is not None else param.high
            key = "exclusiveMinimum" if param.low_open and param.api_low is None else "minimum"
            if param.kind == COUNT:
                low = 1
            if param.kind != NUMBER:  # an integer is at most 64 bits
                low, high = (INT64_MIN if low is None else low), (INT64_MAX if high is None else high)
            assert schema.get(key) == low and schema.get("maximum") == high, field
            assert properties[field]["description"] == param.doc


@pytest.mark.parametrize("param, value", cases(API_PARAMS))
def test_server_bodies_accept_what_the_rule_and_openais_range_accept(param, value):
    body = json.dumps({"messages": MESSAGES, param.name: value})
    try:
        ChatCompletionRequest.model_validate_json(body)
        accepted = True
    except ValidationError as e:
        assert e.errors()[0]["loc"] == (param.name,)  # the 400 names the field
        accepted = False
    assert accepted == api_accepts(param, value)


@pytest.mark.parametrize("param, value", cases(PARAMS[name] for name in SETTINGS))
def test_chat_set_accepts_what_the_rule_accepts_with_the_same_message(param, value):
    shown = CHAT_NAMES.get(param.name, param.name)
    settings = ChatSettings()
    refused = rule_accepts(param, value)
    if refused is None:
        assert apply_setting(settings, shown, str(value), context_length=2**70) == (shown, value)
        assert getattr(settings, shown) == value
    else:
        with pytest.raises(SettingError) as e:
            apply_setting(settings, shown, str(value), context_length=2**70)
        assert str(e.value) == str(refused).replace(param.name, shown, 1)
        assert settings == ChatSettings()


@pytest.mark.parametrize("param, value", cases(API_PARAMS))
def test_batch_lines_accept_what_the_rule_accepts_in_both_shapes(param, value):
    defaults = LineDefaults(GenerationParams(max_tokens=8))
    native = {"id": "a", "prompt": "p", param.name: value}
    openai = {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "p", param.name: value}}
    refused = rule_accepts(param, value)
    for line, shape in ((native, NATIVE), (openai, OPENAI)):
        item = parse_line(json.dumps(line).encode(), 1, defaults, shape)
        if refused is None:
            assert isinstance(item, Job) and getattr(item.params, param.name) == value
        else:
            assert isinstance(item, BadLine) and item.code == refused.code
            assert item.message.startswith(f"{param.name} must be {refused.rule}, got ")


def test_seed_is_nullable_everywhere():
    assert PARAMS["seed"].nullable
    assert ChatCompletionRequest.model_validate({"messages": MESSAGES, "seed": None}).seed is None
    assert apply_setting(ChatSettings(seed=3), "seed", "random", 4096) == ("seed", None)
    job = parse_line(b'{"prompt": "p", "seed": null}', 1, LineDefaults(GenerationParams(seed=4)), NATIVE)
    assert isinstance(job, Job) and job.params.seed is None


def test_the_remote_client_sends_every_parameter_by_name_and_the_server_reads_it_back():
    values = {"temperature": 0.25, "top_k": 7, "top_p": 0.5, "min_p": 0.125, "repetition_penalty": 1.5,
              "presence_penalty": -0.5, "frequency_penalty": 1.25, "seed": 11, "max_tokens": 9}
    assert set(values) == {p.name for p in API_PARAMS}
    body = RemoteClient._sampling_body(GenerationParams(**values))
    request = ChatCompletionRequest.model_validate_json(json.dumps({"messages": MESSAGES, **body}))
    again = request.generation_params(0, default_max_tokens=100)
    assert {name: getattr(again, name) for name in values} == values


def test_defaults_the_engine_for_the_server_the_front_ends_own_for_chat():
    params = ChatCompletionRequest.model_validate({"messages": MESSAGES}).generation_params(0, default_max_tokens=77)
    assert {p.name: getattr(params, p.name) for p in SAMPLING_PARAMS} == {p.name: p.default for p in SAMPLING_PARAMS}
    assert params.max_tokens == 77
    chat = ChatSettings()
    for name in SETTINGS:
        expected = CHAT_DEFAULTS.get(name, PARAMS[name].default)
        assert getattr(chat, CHAT_NAMES.get(name, name)) == expected
        assert getattr(chat.params(), name) == expected
    assert MAX_TOKENS.name in SETTINGS
