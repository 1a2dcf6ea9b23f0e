"""The reasoning splitter: Qwen3 / DeepSeek-R1 <think> blocks (opened in the answer or by the
prompt) and gpt-oss harmony channels, whole and fed in every possible cut (tags split across
deltas give the same split)."""

from __future__ import annotations

import pytest

from exlcli.text.chat_template import ChatTemplate
from exlcli.text.reasoning import (
    prompt_opens_reasoning,
    reasoning_splitter,
    reasoning_syntax,
    split_reasoning,
)
from tests.text.tool_templates import GLM45, GPT_OSS, LLAMA31, QWEN3, QWEN3_THINKING, QWEN25

CASES = [
    # (syntax, starts_inside, text, reasoning, content)
    ("think", False, "<think>\nLet me see: 2+2.\n</think>\n\nIt is 4.", "Let me see: 2+2.\n", "It is 4."),
    ("think", False, "  <think>a < b </thin k></think>ok", "a < b </thin k>", "ok"),
    ("think", True, "The prompt opened it.\n</think>\n\nAnswer", "The prompt opened it.\n", "Answer"),
    ("think", False, "No thinking here, <think> later is text", None, "No thinking here, <think> later is text"),
    ("think", False, "<think>\n\n</think>\n\nEmpty thought", None, "Empty thought"),
    ("think", False, "<think>cut off by max_tokens", "cut off by max_tokens", ""),
    ("think", True, "still thinking <", "still thinking <", ""),
    ("harmony", False, "<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant<|channel|>final"
                       "<|message|>Hello!", "User says hi.", "Hello!"),
    ("harmony", False, "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
                       "to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}", "Need weather.",
     "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}"),
    ("harmony", False, "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>", None,
     "<|channel|>commentary to=functions.f json<|message|>{}<|call|>"),
    ("harmony", False, "plain text, no channels", None, "plain text, no channels"),
    ("auto", False, "<think>hm</think>ok", "hm", "ok"),
    ("auto", False, "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>ok",
     "hm", "ok"),
    ("auto", False, "<thinking is a word", None, "<thinking is a word"),
    (None, False, "<think>kept inline</think>", None, "<think>kept inline</think>"),
]


@pytest.mark.parametrize("syntax, inside, text, reasoning, content", CASES)
def test_whole_answers_split(syntax, inside, text, reasoning, content):
    assert split_reasoning(text, syntax, inside) == (reasoning, content)


@pytest.mark.parametrize("syntax, inside, text, reasoning, content", CASES)
def test_streamed_in_every_cut_gives_the_same_split(syntax, inside, text, reasoning, content):
    for size in range(1, 12):
        splitter = reasoning_splitter(syntax, inside)
        parts = [splitter.feed(text[i:i + size]) for i in range(0, len(text), size)] + [splitter.finish()]
        assert "".join(r for r, _ in parts) == (reasoning or ""), size
        assert "".join(c for _, c in parts) == content, size


def test_streaming_sends_reasoning_before_the_tag_closes():
    splitter = reasoning_splitter("think")
    assert splitter.feed("<thi") == ("", "")
    assert splitter.feed("nk>step one, ") == ("step one, ", "")
    assert splitter.feed("step two</th") == ("step two", "")  # "</th" held: it may close the block
    assert splitter.feed("ink>\n\nDone") == ("", "Done")


def test_the_syntax_comes_from_the_template():
    assert reasoning_syntax(QWEN3) == "think" and reasoning_syntax(GLM45) == "think"
    assert reasoning_syntax(GPT_OSS) == "harmony"
    assert reasoning_syntax(QWEN25) is None and reasoning_syntax(LLAMA31) is None and reasoning_syntax(None) is None


def test_a_prompt_that_opens_think_starts_the_answer_inside_it():
    ask = [{"role": "user", "content": "hi"}]
    assert prompt_opens_reasoning(ChatTemplate(QWEN3_THINKING).render(ask), "think")
    assert not prompt_opens_reasoning(ChatTemplate(QWEN3).render(ask), "think")
    closed = ChatTemplate(QWEN3).render(ask, template_kwargs={"enable_thinking": False})
    assert closed.endswith("<think>\n\n</think>\n\n") and not prompt_opens_reasoning(closed, "think")
    assert not prompt_opens_reasoning("<think>", None)
