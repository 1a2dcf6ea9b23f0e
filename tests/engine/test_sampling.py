"""The generation parameters' declarations (exlcli.engine.sampling): SamplingParams checks itself
against them when made, with one-line errors naming the field."""

from __future__ import annotations

import dataclasses
import math

import pytest

from exlcli.engine.request import Request
from exlcli.engine.sampling import (
    COUNT,
    INT64_MAX,
    INVALID_TYPE,
    INVALID_VALUE,
    MAX_TOKENS,
    NUMBER,
    PARAMS,
    SAMPLING_PARAMS,
    ParamError,
    SamplingParams,
)
from exlcli.errors import RequestError


def test_every_field_of_sampling_params_is_declared_once_with_a_rule_and_a_doc():
    assert [p.name for p in SAMPLING_PARAMS] == [f.name for f in dataclasses.fields(SamplingParams)]
    defaults = SamplingParams()
    for param in PARAMS.values():
        assert param.doc and param.doc.endswith(".") and "\n" not in param.doc
        assert param.kind in (NUMBER, "integer", COUNT)
        if param is not MAX_TOKENS:
            assert getattr(defaults, param.name) == param.default
        param.check(param.default)  # the default obeys its own rule
        # OpenAI's range, where the API has one, is inside the parameter's own
        if param.api_low is not None and param.low is not None:
            assert param.api_low >= param.low
        if param.api_high is not None and param.high is not None:
            assert param.api_high <= param.high


@pytest.mark.parametrize("changes, message", [
    ({"temperature": -1}, "temperature must be >= 0, got -1"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
    ({"presence_penalty": math.inf}, "presence_penalty must be a finite number, got inf"),
    ({"frequency_penalty": "1"}, "frequency_penalty must be a finite number, got '1'"),
    ({"temperature": True}, "temperature must be a finite number, got True"),
    ({"temperature": 10**400}, "temperature must be a finite number, got " + str(10**400)),
    ({"top_k": -1}, "top_k must be an integer >= 0, got -1"),
    ({"top_k": 2.0}, "top_k must be an integer >= 0, got 2.0"),
    ({"top_k": 2**64}, "top_k must be an integer of at most 64 bits, got 18446744073709551616"),
    ({"seed": "7"}, "seed must be an integer, got '7'"),
    ({"seed": INT64_MAX + 1}, "seed must be an integer of at most 64 bits, got 9223372036854775808"),
    ({"logprobs": 21}, "logprobs must be an integer in [0, 20], got 21"),
])
def test_sampling_params_refuse_bad_values_when_made(changes, message):
    with pytest.raises(ParamError) as e:
        SamplingParams(**changes)
    assert str(e.value) == message
    assert isinstance(e.value, RequestError)  # a front end shows it as one line


def test_a_field_set_after_making_is_checked_when_the_request_is_made():
    params = SamplingParams()
    params.top_p = 0.0
    with pytest.raises(ParamError, match=r"top_p must be in \(0, 1\]"):
        Request("r", [1, 2], params)


def test_max_new_tokens_follows_the_max_tokens_rule():
    assert Request("r", [1]).max_new_tokens == MAX_TOKENS.default
    with pytest.raises(RequestError) as e:
        Request("r", [1], max_new_tokens=0)
    assert str(e.value) == "max_new_tokens must be a positive integer, got 0"


@pytest.mark.parametrize("name, value, code", [
    ("temperature", "hot", INVALID_TYPE), ("temperature", -0.5, INVALID_VALUE),
    ("top_k", 1.5, INVALID_TYPE), ("top_k", -1, INVALID_VALUE),
    ("max_tokens", 0, INVALID_TYPE), ("max_tokens", "9", INVALID_TYPE),  # below 1 it is no count at all
])
def test_errors_say_whether_the_type_or_the_range_is_wrong(name, value, code):
    with pytest.raises(ParamError) as e:
        PARAMS[name].check(value)
    assert e.value.code == code and e.value.name == name


def test_check_names_the_front_ends_spelling_and_returns_the_clean_value():
    with pytest.raises(ParamError, match="^repeat_penalty must be > 0, got 0$"):
        PARAMS["repetition_penalty"].check(0, "repeat_penalty")
    assert PARAMS["temperature"].check(1) == 1.0 and isinstance(PARAMS["temperature"].check(1), float)
    assert PARAMS["seed"].check(None) is None
    with pytest.raises(ParamError):
        PARAMS["top_k"].check(None)  # only a nullable parameter takes None
