"""Tool formats: detection from the template, the prompt each template renders for tools, calls and
results, calls parsed back out of answers, and grammars that force a valid call (walked at random
through llguidance's masks: every sentence they allow parses and validates)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from exlcli.engine.constraints import GrammarCompiler, new_bitmask
from exlcli.engine.request import GrammarSpec
from exlcli.text.chat_template import CHATML_TEMPLATE, ChatTemplate
from exlcli.text.tool_formats import HermesFormat, Llama3JsonFormat, MistralFormat, detect_tool_format, prompt_messages
from tests.engine.grammar_helpers import small_bpe_tokenizer
from tests.text.tool_templates import LLAMA31, MISTRAL_V03, QWEN25, TIME_TOOL, WEATHER_TOOL

TOOLS = [WEATHER_TOOL, TIME_TOOL]
NAMES = {"get_weather", "get_time"}


def history(call_id: str = "abcDEF123") -> list[dict]:
    return [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "{\"temp\": 21}"},
    ]


def render(source: str, messages: list[dict], tools: list[dict] | None) -> str:
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    messages, template_tools = prompt_messages(messages, tools, template.source)
    return template.render(messages, True, template_tools)


def test_the_format_comes_from_the_template():
    assert isinstance(detect_tool_format(QWEN25), HermesFormat)
    assert isinstance(detect_tool_format(LLAMA31), Llama3JsonFormat)
    assert isinstance(detect_tool_format(MISTRAL_V03), MistralFormat)
    assert isinstance(detect_tool_format(CHATML_TEMPLATE), HermesFormat)
    assert isinstance(detect_tool_format(None), HermesFormat)


def test_qwen_template_renders_tools_calls_and_results():
    text = render(QWEN25, history(), TOOLS)
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) in text  # the tool objects as the template lists them
    # the call's arguments are an object in the prompt (OpenAI sends them as JSON text)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_llama_template_renders_tools_calls_and_results():
    text = render(LLAMA31, history(), TOOLS)
    assert "Environment: ipython" in text and '"name": "get_time"' in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}<|eot_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n" in text


def test_mistral_template_renders_tools_calls_and_results():
    text = render(MISTRAL_V03, history() + [{"role": "user", "content": "And Rome?"}], TOOLS)
    assert '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather"' in text
    assert ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}, '
            '"id": "abcDEF123"}]</s>') in text
    assert '[TOOL_RESULTS] {"content": {"temp": 21}, "call_id": "abcDEF123"}[/TOOL_RESULTS]' in text
    assert MistralFormat().new_call_id().isalnum() and len(MistralFormat().new_call_id()) == 9


def test_a_template_without_tools_gets_them_in_the_system_message():
    text = render(CHATML_TEMPLATE, history(), TOOLS)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou help.\n\n# Tools") and json.dumps(TIME_TOOL) in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "c"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>" in text


def test_plain_conversations_render_as_before():
    messages = [{"role": "user", "content": "hi"}]
    assert prompt_messages(messages, None, QWEN25) == (messages, None)


@pytest.mark.parametrize("fmt, text, content, calls", [
    (HermesFormat(), 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
     '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Oslo", "unit": "c"}), ("get_time", {"zone": "CET"})]),
    (HermesFormat(), '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>', None, []),  # unknown tool
    (HermesFormat(), "<tool_call>\n{not json\n</tool_call>", None, []),
    (HermesFormat(), "No tools needed.", None, []),
    (Llama3JsonFormat(), ' {"name": "get_time", "parameters": {"zone": "UTC"}}', None, [("get_time", {"zone": "UTC"})]),
    (Llama3JsonFormat(), '{"name": "Bob", "age": 3}', None, []),  # JSON, but no call
    (MistralFormat(), '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}, '
     '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "f"}}]', None,
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Rome", "unit": "f"})]),
    (MistralFormat(), '[{"name": "get_time", "arguments": {"zone": "UTC"}}]', None, [("get_time", {"zone": "UTC"})]),
    (MistralFormat(), "[1, 2, 3]", None, []),
])
def test_calls_are_parsed_back_and_anything_else_stays_content(fmt, text, content, calls):
    parsed = fmt.parse(text, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert parsed.content == (content if calls else text)
    assert len({c.id for c in parsed.calls}) == len(calls)


def test_streamed_text_is_held_only_while_it_may_be_a_call():
    hermes = HermesFormat()
    assert hermes.content_end("Sure, ") == 6
    assert hermes.content_end("Sure, <tool") == 6  # may open a call
    assert hermes.content_end("Sure, <b>") == 9
    assert hermes.content_end("ok <tool_call>\n{") == 3
    llama = Llama3JsonFormat()
    assert llama.content_end("  ") == 0 and llama.content_end(' {"na') == 0 and llama.content_end("<|py") == 0
    assert llama.content_end("Hello") == 5
    mistral = MistralFormat()
    assert mistral.content_end("[TOOL") == 0 and mistral.content_end("It is") == 5


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(small_bpe_tokenizer(), 512, [0])


def walk(compiler: GrammarCompiler, grammar: str, seed: int, max_tokens: int = 400) -> str:
    """A random sentence of `grammar`: each token drawn uniformly from what its mask allows."""
    tok = small_bpe_tokenizer()
    constraint = compiler.constraint(GrammarSpec("grammar", grammar))
    rng = random.Random(seed)
    ids: list[int] = []
    for _ in range(max_tokens):
        if constraint.must_stop():
            break
        mask = new_bitmask(1, 512)
        constraint.fill_mask(mask, 0)
        allowed = [i for i in range(512) if (int(mask[0, i // 32]) >> (i % 32)) & 1]
        # end the sentence where the grammar allows it half the time, else go on
        token = 0 if 0 in allowed and (rng.random() < 0.5 or len(allowed) == 1) else \
            rng.choice([i for i in allowed if i != 0] or allowed)
        assert constraint.accept(token), constraint.error
        if token == 0:
            break
        ids.append(token)
    else:
        pytest.fail("the walk did not end")
    return tok.decode(ids)


@pytest.mark.parametrize("fmt", [HermesFormat(), Llama3JsonFormat(), MistralFormat()], ids=lambda f: f.name)
@pytest.mark.parametrize("forced, parallel", [(None, True), (None, False), ("get_time", True)])
def test_forcing_grammars_allow_only_valid_calls(compiler, fmt, forced, parallel):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    grammar = fmt.grammar(TOOLS, forced, parallel)
    seen = set()
    for seed in range(6):
        text = walk(compiler, grammar, seed)
        parsed = fmt.parse(text, NAMES)
        assert parsed.calls, text
        assert parsed.content is None, text
        if forced or not parallel or isinstance(fmt, Llama3JsonFormat):
            assert len(parsed.calls) == 1, text
        for call in parsed.calls:
            assert forced is None or call.name == forced
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            seen.add(call.name)
    assert forced is not None or seen == NAMES  # both tools come up in six walks


def test_a_special_marker_token_is_forced_by_id():
    grammar = MistralFormat(special_id=lambda text: 5 if text == "[TOOL_CALLS]" else None).grammar(TOOLS, None, True)
    assert grammar.startswith("start: <[5]> %json ")


ADDRESS_TOOL = {"type": "function", "function": {"name": "ship", "parameters": {
    # as openai.pydantic_function_tool writes a model with a nested model
    "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}},
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}},
    "required": ["to"], "additionalProperties": False}}}
TREE_TOOL = {"type": "function", "function": {"name": "tree", "parameters": {
    "type": "object", "properties": {"label": {"type": "string", "maxLength": 4},
                                     "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}},
    "required": ["label"], "additionalProperties": False}}}


@pytest.mark.parametrize("fmt", [HermesFormat(), Llama3JsonFormat(), MistralFormat()], ids=lambda f: f.name)
@pytest.mark.parametrize("tool", [ADDRESS_TOOL, TREE_TOOL], ids=["defs", "root"])
@pytest.mark.parametrize("forced", [True, False], ids=["named", "required"])
def test_forced_calls_resolve_refs_against_the_tools_own_schema(compiler, fmt, tool, forced):
    name, schema = tool["function"]["name"], tool["function"]["parameters"]
    grammar = fmt.grammar([WEATHER_TOOL, tool], name if forced else None, False)
    seen = 0
    for seed in range(8):
        parsed = fmt.parse(walk(compiler, grammar, seed, max_tokens=600), NAMES | {name})
        assert len(parsed.calls) == 1
        call = parsed.calls[0]
        schemas = {name: schema, WEATHER_TOOL["function"]["name"]: WEATHER_TOOL["function"]["parameters"]}
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        seen += call.name == name
    assert seen >= 1
