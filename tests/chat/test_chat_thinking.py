"""A thinking model in the chat: its reasoning shown dimmed above the answer on a terminal, or
folded to one line with /think off (/think last prints it); in plain output the reasoning comes
first, a blank line, then the answer; the conversation keeps the answer as the model wrote it."""

from __future__ import annotations

import re

from chat_helpers import ScriptedClient, chat_requests, run_chat
from test_chat_tty import tty_chat

SGR = re.compile(r"\x1b\[[0-9;]*m")
# the tags cut across pieces, as tokens come
THINKING = ["<thi", "nk>\nThe user greets", " me.\n</th", "ink>\n\n", "Hello **there**!"]
HARMONY = ["<|channel|>analysis<|message|>Greeting", ".<|end|><|start|>assistant<|channel|>final<|message|>", "Hi!"]


def test_plain_output_has_the_reasoning_then_the_answer():
    t = run_chat(["hi"], client=ScriptedClient(THINKING))
    assert t.stdout == "The user greets me.\n\nHello **there**!\n"
    t = run_chat(["hi"], client=ScriptedClient(HARMONY))
    assert t.stdout == "Greeting.\n\nHi!\n"


def test_think_off_leaves_the_answer_alone_and_last_prints_the_reasoning():
    t = run_chat(["/think off", "hi", "/think last"], client=ScriptedClient(THINKING))
    assert t.stdout == "Hello **there**!\n"
    assert "reasoning folded" in t.stderr and "The user greets me." in t.stderr
    t = run_chat(["/think maybe"], client=ScriptedClient(THINKING))
    assert "/think takes on, off or last" in t.stderr


def test_the_conversation_keeps_the_answer_as_written():
    t = run_chat(["hi", "again"], client=ScriptedClient(THINKING))
    messages, _ = chat_requests(t.client)[1]
    assert messages[1] == {"role": "assistant", "content": "".join(THINKING)}


def test_on_a_terminal_the_reasoning_is_dim_and_folds():
    _, _, out, _ = tty_chat("hi\r/bye\r", client=ScriptedClient(THINKING))
    assert re.search(r"\x1b\[[0-9;]*2;3m[^\x1b]*The user greets me\.", out), out  # dim italic
    plain = SGR.sub("", out)
    assert "<think>" not in plain and "\x1b[1mthere\x1b[0m" in out  # the answer still Markdown
    _, _, out, _ = tty_chat("/think off\rhi\r/bye\r", client=ScriptedClient(THINKING))
    plain = SGR.sub("", out)
    assert "The user greets me." not in plain and "▸ thought for 4 words" in plain
