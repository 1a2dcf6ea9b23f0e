"""The tool formats of current models (Qwen3-Coder and GLM-4.5 XML, gpt-oss harmony) read back
from answers, whole and streamed; and every format's forcing grammar accepts the call exactly as
the model writes it, with the tags as special tokens, user-defined tokens or plain text."""

from __future__ import annotations

import json

import pytest

from exlcli.engine.constraints import GrammarCompiler
from exlcli.engine.request import GrammarSpec
from exlcli.server.tool_calls import ToolCallStream, ToolPlan
from exlcli.text.tool_formats import FORMATS, Glm45Format, HarmonyFormat, Qwen3CoderFormat, detect_tool_format
from tests.text.marker_tokenizers import HARMONY_TAGS, TOOL_TAGS, marker_tokenizer
from tests.text.tool_templates import GLM45, GPT_OSS, QWEN3_CODER, TIME_TOOL, WEATHER_TOOL

TYPED_TOOL = {"type": "function", "function": {"name": "resize", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "width": {"type": "integer"},
                                     "keep": {"type": "boolean"},
                                     "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["path", "width"]}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL, TYPED_TOOL]
NAMES = {"get_weather", "get_time", "resize"}

# each call as its model writes it (the shape its chat template writes calls in)
WRITTEN = {
    "hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}\n</tool_call>',
    "llama3_json": '{"name":"get_weather","parameters":{"city":"Paris","unit":"c"}}',
    "mistral": '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\nc\n"
                   "</parameter>\n</function>\n</tool_call>",
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>unit</arg_key>\n"
             "<arg_value>c</arg_value>\n</tool_call>",
    "harmony": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris","unit":"c"}',
}


# free text (code, "<", newlines) and typed arguments, in the XML formats
WRITTEN_TYPED = {
    "qwen3_coder": "<tool_call>\n<function=resize>\n<parameter=path>\nif a < b:\n    x = 1\n</parameter>\n"
                   "<parameter=width>\n640\n</parameter>\n</function>\n</tool_call>",
    "glm45": "<tool_call>resize\n<arg_key>path</arg_key>\n<arg_value>if a < b:\n    x = 1</arg_value>\n"
             "<arg_key>width</arg_key>\n<arg_value>640</arg_value>\n</tool_call>",
}


def test_the_format_comes_from_the_template():
    assert detect_tool_format(QWEN3_CODER).name == "qwen3_coder"
    assert detect_tool_format(GLM45).name == "glm45"
    assert detect_tool_format(GPT_OSS).name == "harmony"
    assert detect_tool_format(QWEN3_CODER, name="hermes").name == "hermes"
    with pytest.raises(ValueError, match="known: hermes"):
        detect_tool_format(None, name="nope")


@pytest.mark.parametrize("name", list(WRITTEN))
def test_each_written_call_parses(name):
    fmt = FORMATS[name]().know_tools(TOOLS)
    parsed = fmt.parse("Sure." + WRITTEN[name] if name in ("hermes", "qwen3_coder", "glm45") else WRITTEN[name],
                       NAMES)
    [call] = parsed.calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "unit": "c"}


def test_xml_arguments_take_their_schema_types():
    text = ("<tool_call>\n<function=resize>\n<parameter=path>\n/tmp/a b.png\n</parameter>\n<parameter=width>\n640\n"
            "</parameter>\n<parameter=keep>\ntrue\n</parameter>\n<parameter=tags>\n[\"x\", \"y\"]\n</parameter>\n"
            "</function>\n</tool_call>")
    [call] = Qwen3CoderFormat().know_tools(TOOLS).parse(text, NAMES).calls
    assert json.loads(call.arguments) == {"path": "/tmp/a b.png", "width": 640, "keep": True, "tags": ["x", "y"]}
    glm = ("<tool_call>resize\n<arg_key>path</arg_key>\n<arg_value>if a < b: pass</arg_value>\n<arg_key>width</arg_key>"
           "\n<arg_value>12</arg_value>\n</tool_call>")
    [call] = Glm45Format().know_tools(TOOLS).parse(glm, NAMES).calls
    assert json.loads(call.arguments) == {"path": "if a < b: pass", "width": 12}


def test_unknown_tools_and_broken_blocks_stay_content():
    text = "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>"
    assert Qwen3CoderFormat().parse(text, NAMES).calls == [] and Qwen3CoderFormat().parse(text, NAMES).content == text
    assert HarmonyFormat().parse("<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{oops",
                                 NAMES).calls == []


def test_harmony_reads_the_recipient_before_the_channel_too():
    text = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone":"UTC"}<|call|>'
    [call] = HarmonyFormat().parse(text, NAMES).calls
    assert call.name == "get_time" and json.loads(call.arguments) == {"zone": "UTC"}


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder", "glm45", "harmony"])
def test_streamed_calls_hold_back_only_what_may_be_a_call(name):
    plan = ToolPlan(TOOLS, None, False, True, FORMATS[name]().know_tools(TOOLS))
    stream = ToolCallStream(plan)
    text = "Let me check. " + WRITTEN[name]
    sent = "".join(stream.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    assert sent == "Let me check. "  # the call itself held back, whatever the cut
    deltas, reason = stream.finish("stop")
    assert reason == "tool_calls"
    names = [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d and
             "name" in d["tool_calls"][0]["function"]]
    assert names == ["get_weather"]


@pytest.mark.parametrize("kind", ["special", "user", "text"])
@pytest.mark.parametrize("name", list(WRITTEN))
def test_forcing_grammars_accept_the_call_as_the_model_writes_it(name, kind):
    tags = TOOL_TAGS + HARMONY_TAGS + ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    tokenizer = marker_tokenizer(kind, tags)
    fmt = FORMATS[name](tokenizer.marker_id)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    for forced in (None, "get_weather"):
        constraint = compiler.constraint(GrammarSpec("grammar", fmt.grammar(TOOLS, forced, False)))
        ids = tokenizer.encode(WRITTEN[name], add_special_tokens=False)
        if kind != "text" and name not in ("llama3_json",):
            assert any(i in tokenizer.added_token_ids for i in ids)  # the tags are tokens of their own
        for token in ids:
            assert constraint.accept(token), (name, kind, tokenizer.decode([token], False), constraint.error[:300])
        assert constraint.matcher.is_accepting()
    if name in WRITTEN_TYPED:
        constraint = compiler.constraint(GrammarSpec("grammar", fmt.grammar(TOOLS, "resize", False)))
        for token in tokenizer.encode(WRITTEN_TYPED[name], add_special_tokens=False):
            assert constraint.accept(token), (name, kind, tokenizer.decode([token], False), constraint.error[:300])
        assert constraint.matcher.is_accepting()
        [call] = fmt.know_tools(TOOLS).parse(WRITTEN_TYPED[name], NAMES).calls
        assert json.loads(call.arguments) == {"path": "if a < b:\n    x = 1", "width": 640}


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder", "glm45"])
def test_a_call_is_sent_as_soon_as_its_block_closes(name):
    stream = ToolCallStream(ToolPlan(TOOLS, None, False, True, FORMATS[name]().know_tools(TOOLS)))
    first, second = WRITTEN[name], WRITTEN[name].replace("Paris", "Rome")
    for i in range(0, len(first), 5):
        stream.feed(first[i:i + 5])
        early = stream.ready()
        assert not early or i + 5 >= len(first)
    assert [d["tool_calls"][0]["index"] for d in early] == [0, 0] and early[0]["tool_calls"][0]["id"]
    stream.feed("\n" + second)
    deltas, reason = stream.finish("stop")
    assert reason == "tool_calls" and [d["tool_calls"][0]["index"] for d in deltas] == [1, 1]  # the first not again
    assert "Rome" in deltas[1]["tool_calls"][0]["function"]["arguments"]
