"""`/format`: the chat's answers held to JSON, a schema file, a regex or a grammar; bad input is one
line and changes nothing."""

from __future__ import annotations

import json
import re

import jsonschema
import torch
from chat_helpers import chat_requests, run_chat

from exlcli.chat.settings import ChatSettings
from exlcli.client.local import LocalClient
from exlcli.engine.engine import EngineConfig
from exlcli.engine.request import GrammarSpec
from exlcli.model.architectures import build_model
from exlcli.model.loader import LoadedModel
from exlcli.model.random_weights import random_config, random_tensors
from exlcli.text.chat_template import ChatTemplate
from tests.engine.grammar_helpers import SCHEMAS, small_bpe_tokenizer


def test_format_sets_the_constraint_of_the_next_answers(tmp_path):
    schema_file = tmp_path / "s.json"
    schema_file.write_text(json.dumps(SCHEMAS["enum"]))
    grammar_file = tmp_path / "g.lark"
    grammar_file.write_text('start: "x"+\n')
    t = run_chat(["/format json", "one", f"/format schema {schema_file}", "two", "/format regex (yes|no)", "three",
                  f"/format grammar {grammar_file}", "four", "/format", "/format off", "five"])
    grammars = [params.grammar for _, params in chat_requests(t.client)]
    assert grammars == [GrammarSpec("json_object"), GrammarSpec("json_schema", SCHEMAS["enum"], strict=False),
                        GrammarSpec("regex", "(yes|no)"), GrammarSpec("grammar", 'start: "x"+\n'), None]
    assert "answers: a JSON object" in t.stderr and "answers: text matching the regex '(yes|no)'" in t.stderr
    assert t.stderr.count("answers: text in a grammar") == 2 and "answers: free text" in t.stderr


def test_bad_formats_are_one_line_and_keep_the_format(tmp_path):
    bad_schema = tmp_path / "bad.json"
    bad_schema.write_text('{"type": "object", "properties": {"a": {"type": "objekt"}}}')
    not_json = tmp_path / "nj.json"
    not_json.write_text("{oops")
    t = run_chat(["/format json", "/format yaml", f"/format schema {tmp_path / 'missing.json'}",
                  f"/format schema {bad_schema}", f"/format schema {not_json}", "/format regex", "/show", "hi"])
    errors = [line for line in t.stderr.splitlines() if "format" in line.lower() or "json" in line.lower()]
    assert any("use /format [json | schema FILE | regex R | grammar FILE | off]" in e for e in errors)
    assert any("cannot read" in e and "missing.json" in e for e in errors)
    assert any("invalid JSON schema" in e and "objekt" in e for e in errors)
    assert any("is not JSON" in e for e in errors)
    assert "Traceback" not in t.stderr
    assert "answers: a JSON object" in t.stderr.split("model:")[1]  # /show
    [(_, params)] = chat_requests(t.client)
    assert params.grammar == GrammarSpec("json_object")


def test_the_engine_holds_chat_answers_to_the_format(tmp_path):
    schema_file = tmp_path / "s.json"
    schema_file.write_text(json.dumps(SCHEMAS["number_range"]))
    cfg = random_config("tiny")
    model = build_model(cfg, random_tensors(cfg), torch.device("cpu"), torch.bfloat16)
    loaded = LoadedModel("tiny", "", cfg, model, small_bpe_tokenizer(), ChatTemplate(None), "random bf16", 0.0)
    client = LocalClient(loaded, EngineConfig(max_model_len=1024), threaded=False)
    try:
        t = run_chat(["/format regex [A-Z]{3}-[0-9]{4}", "code?", f"/format schema {schema_file}", "object?"],
                     client=client, settings=ChatSettings(temperature=1.0, seed=4, max_tokens=200))
    finally:
        client.close()
    first, second = t.stdout.splitlines()[:2]
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", first), first
    jsonschema.validate(json.loads(second), SCHEMAS["number_range"])
