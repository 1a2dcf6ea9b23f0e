"""ChatTemplate renders exactly as transformers' chat-template renderer does, and turns bad
conversations into one RequestError. (The default model's own template is checked against
apply_chat_template in test_tokenizer_gguf.py.)"""

from __future__ import annotations

import pytest

from exlcli.errors import ModelLoadError, RequestError
from exlcli.text.chat_template import CHATML_TEMPLATE, ChatTemplate

LLAMA3_LIKE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set msgs = messages[1:] %}{% else %}{% set sys = 'Today is ' + strftime_now('%Y') %}"
    "{% set msgs = messages %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{{ sys }}<|eot_id|>"
    "{% for m in msgs %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
    "<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# block tags on their own lines: only right with trim_blocks and lstrip_blocks, as HF sets them
MULTILINE = """{% for message in messages %}
    {% if message.role == 'system' %}
<<SYS>>{{ message.content | tojson }}<</SYS>>
    {% else %}
[{{ message.role }}] {{ message.content }}{{ eos_token }}
    {% endif %}
    {% if loop.index > 3 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
[assistant]
{% endif %}"""

GENERATION_TAG = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
                  "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}")

SYSTEM = {"role": "system", "content": "Be brief & <safe>. Ünï \"q\""}
CHAT = [{"role": "user", "content": "  Hi 😀  "}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What's 2+2?"}]


def hf_render(template: str, messages, add_generation_prompt: bool, **tokens) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                        add_generation_prompt=add_generation_prompt, **tokens)
    return rendered[0]


@pytest.mark.parametrize("source", [LLAMA3_LIKE, MULTILINE, GENERATION_TAG, CHATML_TEMPLATE])
@pytest.mark.parametrize("with_system", [False, True])
@pytest.mark.parametrize("gen", [False, True])
def test_renders_like_transformers(source, with_system, gen):
    messages = ([SYSTEM] if with_system else []) + CHAT
    tokens = {"bos_token": "<|begin_of_text|>", "eos_token": "</s>"}
    ours = ChatTemplate(source, **tokens).render(messages, add_generation_prompt=gen)
    assert ours == hf_render(source, messages, gen, **tokens)
    assert "Hello!" in ours


def test_tojson_keeps_unicode_and_html_characters():
    out = ChatTemplate(MULTILINE).render([SYSTEM, *CHAT])
    assert '<<SYS>>"Be brief & <safe>. Ünï \\"q\\""<</SYS>>' in out


def test_fallback_is_chatml():
    t = ChatTemplate(None, "", "")
    assert t.is_fallback
    out = t.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert out == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert t.render([{"role": "user", "content": "U"}], add_generation_prompt=False).endswith("<|im_end|>\n")


def test_messages_are_not_modified():
    messages = [dict(m) for m in CHAT]
    ChatTemplate(LLAMA3_LIKE).render(messages)
    assert messages == CHAT


@pytest.mark.parametrize("messages, problem", [
    ("hello", "non-empty list"),
    ([], "non-empty list"),
    (["hello"], "message 0 is not an object"),
    ([{"content": "x"}], "'role' must be a non-empty string"),
    ([{"role": "user"}], "'content' must be a string"),
    ([{"role": "user", "content": None}], "'content' must be a string"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "'content' must be a string"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "roles must alternate"),
])
def test_bad_conversations_are_request_errors(messages, problem):
    with pytest.raises(RequestError, match=problem):
        ChatTemplate(LLAMA3_LIKE).render(messages)


def test_template_cannot_escape_the_sandbox():
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(RequestError, match="chat template"):
        evil.render(CHAT)
    mutate = ChatTemplate("{% set _ = messages.append(1) %}x")
    with pytest.raises(RequestError):
        mutate.render(CHAT)


def test_template_that_does_not_parse_is_a_load_error():
    with pytest.raises(ModelLoadError, match="does not parse"):
        ChatTemplate("{% for m in messages %}no end")
