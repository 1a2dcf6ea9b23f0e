"""Structured-output keys in batch lines: json_schema, regex, grammar and response_format (native
lines and OpenAI batch bodies) become the job's GrammarSpec; conflicts and bad values are line errors."""

import json

from exlcli.batch.lines import OPENAI, BadLine, Job, LineDefaults, parse_line
from exlcli.client.base import GenerationParams
from exlcli.engine.request import GrammarSpec

DEFAULTS = LineDefaults(GenerationParams(max_tokens=32), system=None)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def parse(obj, file_shape="native"):
    return parse_line(json.dumps(obj).encode(), 3, DEFAULTS, file_shape)


def test_native_keys_give_the_constraint():
    assert parse({"prompt": "x", "json_schema": SCHEMA}).params.grammar == GrammarSpec("json_schema", SCHEMA)
    assert parse({"prompt": "x", "regex": "[0-9]+"}).params.grammar == GrammarSpec("regex", "[0-9]+")
    assert parse({"prompt": "x", "grammar": 'start: "a"'}).params.grammar == GrammarSpec("grammar", 'start: "a"')
    job = parse({"prompt": "x", "response_format": {"type": "json_object"}})
    assert isinstance(job, Job) and job.params.grammar == GrammarSpec("json_object")
    assert parse({"prompt": "x"}).params.grammar is None
    assert DEFAULTS.params.grammar is None  # the shared default is not changed


def test_openai_body_response_format():
    line = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}],
                     "response_format": {"type": "json_schema",
                                         "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}}}
    job = parse(line, OPENAI)
    assert isinstance(job, Job) and job.params.grammar == GrammarSpec("json_schema", SCHEMA, strict=True)


def test_bad_or_conflicting_constraints_are_line_errors():
    for obj, words in [({"prompt": "x", "regex": "a", "json_schema": SCHEMA}, "cannot be used together"),
                       ({"prompt": "x", "json_schema": "not a schema"}, "JSON Schema object"),
                       ({"prompt": "x", "regex": ""}, "non-empty string"),
                       ({"prompt": "x", "response_format": {"type": "xml"}}, "json_object or json_schema")]:
        bad = parse(obj)
        assert isinstance(bad, BadLine) and words in bad.message, (obj, bad)
