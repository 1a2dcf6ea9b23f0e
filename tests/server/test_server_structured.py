"""response_format (json_object, json_schema) through the openai SDK against a real uvicorn."""

import io
import json

import jsonschema
import openai
import pydantic
import pytest
from server_helpers import running_server
from test_server_openai_sdk import sdk


def test_bad_response_format_is_400_naming_the_problem(fake_server):
    client = sdk(fake_server)
    messages = [{"role": "user", "content": "hi"}]
    for fmt, words in [({"type": "yaml"}, "json_object or json_schema"),
                       ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs"),
                       ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
                        "strict")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="fake-echo", messages=messages, response_format=fmt)
        assert words in str(e.value)
    # text is the default, and still accepted
    reply = client.chat.completions.create(model="fake-echo", messages=messages, response_format={"type": "text"})
    assert reply.choices[0].message.content == "echo: hi"


def served_name(server) -> str:
    """The name the server answers to (it refuses any other with model_not_found)."""
    return sdk(server).models.list().data[0].id


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    population: int = pydantic.Field(ge=0, le=100_000_000)
    country: str = pydantic.Field(max_length=24)


class Answer(pydantic.BaseModel):
    cities: list[City] = pydantic.Field(min_length=1, max_length=3)
    capital: bool


@pytest.fixture(scope="module")
def real_server(default_model_path):
    from exlcli.client.local import LocalClient

    client = LocalClient.from_model(default_model_path, log=io.StringIO())
    with running_server(client) as live:
        yield live
    client.close()


@pytest.mark.slow
def test_chat_completions_parse_with_a_pydantic_model(real_server):
    reply = sdk(real_server).chat.completions.parse(
        model=served_name(real_server),
        messages=[{"role": "user", "content": "Name the largest city of France as JSON."}],
        response_format=Answer, temperature=0, max_tokens=200)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Answer) and choice.message.parsed.cities


@pytest.mark.slow
def test_json_schema_and_json_object_on_chat_and_completions(real_server):
    client = sdk(real_server)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    reply = client.chat.completions.create(model=served_name(real_server),
                                           messages=[{"role": "user", "content": "Is water wet?"}],
                                           response_format=fmt, temperature=0.8, seed=3, n=3, max_tokens=60)
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    text = client.completions.create(model=served_name(real_server), prompt="A JSON object describing a cat:",
                                     max_tokens=120,
                                     temperature=0, extra_body={"response_format": {"type": "json_object"}})
    if text.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text.choices[0].text), dict)
    else:
        assert text.choices[0].finish_reason == "length" and text.choices[0].text.startswith("{")


@pytest.mark.slow
def test_a_schema_that_does_not_compile_is_400(real_server):
    with pytest.raises(openai.BadRequestError) as e:
        sdk(real_server).chat.completions.create(
            model=served_name(real_server), messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objekt"}}})
    assert "objekt" in str(e.value)
