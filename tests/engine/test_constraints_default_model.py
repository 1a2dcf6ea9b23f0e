"""Structured output on the default model (SmolLM2-135M-Instruct): every schema of the suite,
greedy and sampled, in one batch with a free request; outputs parse and validate."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import FinishReason, GrammarSpec, Request, SamplingParams
from tests.engine.grammar_helpers import SCHEMAS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loaded(default_model_path):
    from exlcli.model.loader import load_model

    return load_model(default_model_path, device="cpu")


def test_schema_suite_and_regex_on_the_default_model(loaded):
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig())
    prompt = loaded.chat_template.encode(
        loaded.tokenizer, [{"role": "user", "content": "Answer with a small JSON document."}], True)
    requests, checks = [], []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        temp = 0.0 if i % 2 else 0.8
        requests.append(Request(name, prompt, SamplingParams(temperature=temp, seed=i), max_new_tokens=160,
                                grammar=GrammarSpec("json_schema", schema)))
        checks.append(lambda text, schema=schema: jsonschema.validate(json.loads(text), schema))
    pattern = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
    requests.append(Request("date", prompt, SamplingParams(temperature=0.0), max_new_tokens=20,
                            grammar=GrammarSpec("regex", pattern)))
    checks.append(lambda text: re.fullmatch(pattern, text) or pytest.fail(text))
    requests.append(Request("free", prompt, SamplingParams(temperature=0.0), max_new_tokens=20))
    handles = [engine.submit(r) for r in requests]
    engine.run_until_idle()
    for handle, check in zip(handles, checks + [None]):
        outs = list(handle)
        text = "".join(o.new_text for o in outs)
        if check is None:
            assert outs[-1].finish_reason is FinishReason.LENGTH
            continue
        assert outs[-1].finish_reason is FinishReason.STOP, (handle.request_id, text)
        check(text)
