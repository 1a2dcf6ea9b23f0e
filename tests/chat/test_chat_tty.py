"""The terminal path: prompt-toolkit input (pipe-fed), Rich live Markdown output (width pinned)."""

from __future__ import annotations

import io
import re

import pytest
from chat_helpers import ScriptedClient, chat_requests, screen_lines
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from exlcli.chat.app import ChatApp
from exlcli.chat.io import ChatIO
from exlcli.chat.session import Conversation
from exlcli.client.fake import FakeClient

SGR = re.compile(r"\x1b\[[0-9;]*m")  # colour and style codes
MARKDOWN_ANSWER = ["Here is **bold** text.\n\n", "```python\n", "def add(x, y):\n", "    return x + y\n", "```\n"]


def tty_chat(keys: str, client=None, color=True, history_file=None, height=20):
    out, err = io.StringIO(), io.StringIO()
    client = client if client is not None else ScriptedClient(MARKDOWN_ANSWER)
    with create_pipe_input() as pipe:
        pipe.send_text(keys)
        chat_io = ChatIO(stdout=out, stderr=err, interactive=True, color=color, width=100, height=height,
                         history_file=history_file, pt_input=pipe, pt_output=DummyOutput())
        app = ChatApp(client, chat_io, conversation=Conversation())
        app.run()
    return app, client, out.getvalue(), err.getvalue()


def test_answer_is_rendered_as_markdown_with_a_highlighted_code_block():
    _, _, out, err = tty_chat("show me code\r/bye\r")
    plain = SGR.sub("", out)
    assert "```" not in plain and "**" not in plain  # Markdown syntax rendered, not shown
    assert "\x1b[1mbold\x1b[0m" in out  # bold is bold
    assert re.search(r"\x1b\[[0-9;]*mdef\x1b\[0m", out)  # the keyword is coloured by the highlighter
    assert "return x + y" in plain
    assert "12 prompt tokens (8 cached), first token 45 ms, 5 tokens at 21.5 tok/s" in SGR.sub("", err)
    assert "/help for commands" in SGR.sub("", err)  # the banner, on a terminal only


def test_no_color_keeps_escape_codes_for_style_out(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    _, _, out, err = tty_chat("show me code\r/bye\r", color=None)
    assert "def add(x, y):" in out
    assert not SGR.search(out) and not SGR.search(err)


def test_alt_enter_makes_a_new_line_and_history_is_kept(tmp_path):
    history = tmp_path / "history"
    _, client, _, _ = tty_chat("first line\x1b\rsecond line\r/bye\r", client=FakeClient(), history_file=history)
    (messages, _), = chat_requests(client)
    assert messages[-1]["content"] == "first line\nsecond line"
    saved = history.read_text()
    assert "+first line\n+second line" in saved and "+/bye" in saved


def test_triple_quote_block_at_the_prompt():
    _, client, _, _ = tty_chat('"""\rone\r\rtwo\r"""\r/bye\r', client=FakeClient())
    (messages, _), = chat_requests(client)
    assert messages[-1]["content"] == "one\n\ntwo"


def test_ctrl_c_at_the_prompt_clears_the_line_and_ctrl_d_leaves():
    app, client, _, _ = tty_chat("typed then abandoned\x03hi\r\x04never\r", client=FakeClient())
    assert [m[-1]["content"] for m, _ in chat_requests(client)] == ["hi"]
    assert [t.user for t in app.conversation.turns] == ["hi"]


@pytest.mark.parametrize("num_lines", [3, 40])
def test_a_long_answer_streams_through_a_short_screen_each_line_once(num_lines):
    pieces = [f"line {i:02d}\n\n" for i in range(num_lines)]
    _, _, out, _ = tty_chat("long\r/bye\r", client=ScriptedClient(pieces, delay=0.01), height=10)
    shown = [line for line in screen_lines(out) if line]
    assert shown == [f"line {i:02d}" for i in range(num_lines)]


def test_unwritable_history_is_a_notice_and_the_chat_goes_on(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    _, client, _, err = tty_chat("hi\r/bye\r", client=FakeClient(), history_file=blocker / "history")
    assert "input history not saved: cannot write" in err
    assert len(chat_requests(client)) == 1
