"""A model's answer that holds escape sequences (issue 56: OSC 52 clipboard, OSC 0 title, CSI 2J)
reaches the terminal without them, on the live Markdown view and the plain path, while the
colours exlcli itself adds stay."""

from __future__ import annotations

import io
import re

from chat_helpers import ScriptedClient, run_chat
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from exlcli.chat.app import ChatApp
from exlcli.chat.io import ChatIO
from exlcli.chat.session import Conversation

# The attack cut across the pieces of the stream, as a tokenizer would.
HOSTILE = ["Sure, **here** it is.\x1b]52;c;ZWNo", "byBwd25lZA==\x07 Title:\x1b]0;pwned\x1b", "\\ clear:\x1b[2",
           "J\x1b[H done.\x9b31m red\x07\x08\r\n"]
# What a terminal acts on: any ESC not opening Rich's own SGR colour codes or the live view's cursor
# moves, any BEL, 8-bit C1 or backspace.
FOREIGN = re.compile(r"\x1b(?!\[[0-9;]*m|\[[0-9]*[AK]|\[\?25[lh])|[\x07\x08\x80-\x9f]")


def test_the_live_markdown_view_drops_the_model_s_escape_sequences_and_keeps_its_own_colours():
    out, err = io.StringIO(), io.StringIO()
    with create_pipe_input() as pipe:
        pipe.send_text("hi\r/bye\r")
        chat_io = ChatIO(stdout=out, stderr=err, interactive=True, color=True, width=100, height=20,
                         history_file=None, pt_input=pipe, pt_output=DummyOutput())
        ChatApp(ScriptedClient(HOSTILE), chat_io, conversation=Conversation()).run()
    shown = out.getvalue()
    assert FOREIGN.findall(shown) == []
    assert "]52;" not in shown and "pwned" not in shown and "\x1b[2J" not in shown
    assert "\x1b[1mhere\x1b[0m" in shown  # Rich's bold, exlcli's own styling, is kept
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown)
    assert "Title: clear: done. red" in plain


def test_the_plain_path_writes_the_answer_without_any_control_sequence():
    transcript = run_chat(["hi"], client=ScriptedClient(HOSTILE))
    assert transcript.stdout == "Sure, **here** it is. Title: clear: done. red\n\n"  # its own newline, then the end


def test_a_server_error_quoted_in_a_notice_is_made_safe_too():
    transcript = run_chat(["hi"], client=ScriptedClient(["x"], error="boom\x1b]0;pwned\x07 end"))
    assert "\x1b" not in transcript.stderr and "\x07" not in transcript.stderr
    assert "boom end" in transcript.stderr
