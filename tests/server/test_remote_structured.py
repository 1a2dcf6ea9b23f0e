"""RemoteClient forwards a request's constraint (JSON object, JSON schema, regex, grammar) to the
server as response_format, and the served engine holds the text to it."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from server_helpers import running_server

from exlcli.client.base import GenerationParams
from exlcli.client.local import LocalClient
from exlcli.client.remote import RemoteClient
from exlcli.engine.engine import EngineConfig
from exlcli.engine.request import GrammarSpec, grammar_from_response_format, response_format_of
from exlcli.errors import RequestError
from exlcli.model.architectures import build_model
from exlcli.model.loader import LoadedModel
from exlcli.model.random_weights import random_config, random_tensors
from exlcli.text.chat_template import ChatTemplate
from tests.engine.grammar_helpers import SCHEMAS, small_bpe_tokenizer

SPECS = [GrammarSpec("json_object"), GrammarSpec("json_schema", SCHEMAS["enum"], strict=True),
         GrammarSpec("json_schema", SCHEMAS["nested"], strict=False), GrammarSpec("regex", r"(yes|no)"),
         GrammarSpec("grammar", 'start: "a"+ "b"\n')]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_response_format_reads_back_as_the_same_constraint(spec):
    assert grammar_from_response_format(response_format_of(spec)) == spec
    text_schema = GrammarSpec("json_schema", json.dumps(SCHEMAS["enum"]))
    assert grammar_from_response_format(response_format_of(text_schema)).value == SCHEMAS["enum"]


def test_remote_client_sends_each_constraint(fake_server):
    remote = RemoteClient(fake_server.url)
    for spec in SPECS:
        remote.chat([{"role": "user", "content": "hi"}], GenerationParams(grammar=spec)).collect()
        remote.complete("hi", GenerationParams(grammar=spec)).collect()
    remote.complete("hi", GenerationParams()).collect()
    sent = [params.grammar for _, _, params in fake_server.state.client.requests]
    assert sent == [s for s in SPECS for _ in range(2)] + [None]
    with pytest.raises(RequestError, match="tools"):
        remote.chat([{"role": "user", "content": "hi"}], GenerationParams(tools=[{"type": "function"}]))
    remote.close()


def test_bad_constraint_types_are_refused(fake_server):
    remote = RemoteClient(fake_server.url)
    for body, words in [({"type": "regex"}, "non-empty string"), ({"type": "grammar", "grammar": 3}, "non-empty")]:
        with pytest.raises(RequestError, match=words):
            grammar_from_response_format(body)
    remote.close()


@pytest.fixture(scope="module")
def tiny_served():
    cfg = random_config("tiny")
    model = build_model(cfg, random_tensors(cfg), torch.device("cpu"), torch.bfloat16)
    loaded = LoadedModel("tiny", "", cfg, model, small_bpe_tokenizer(), ChatTemplate(None), "random bf16", 0.0)
    client = LocalClient(loaded, EngineConfig(max_model_len=1024))
    with running_server(client) as live:
        yield live
    client.close()


def test_the_served_engine_holds_remote_requests_to_their_constraint(tiny_served):
    remote = RemoteClient(tiny_served.url)
    for seed in range(3):
        text, last = remote.complete("The", GenerationParams(grammar=GrammarSpec("regex", r"[A-Z]{3}-[0-9]{2,4}"),
                                                             temperature=1.0, seed=seed, max_tokens=20)).collect()
        assert last.finish_reason == "stop" and re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", text), text
        text, last = remote.chat([{"role": "user", "content": "hi"}], GenerationParams(
            grammar=GrammarSpec("json_schema", SCHEMAS["array_bounds"]), temperature=1.0, seed=seed,
            max_tokens=200)).collect()
        assert last.finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMAS["array_bounds"])
    with pytest.raises(RequestError, match="invalid regex"):
        remote.complete("The", GenerationParams(grammar=GrammarSpec("regex", "[a-")))
    remote.close()
