"""Model text reaches a terminal with no control sequence left: the attacks of issue 56, every C0/C1
control, sequences cut between streamed pieces, and plain text (tabs, newlines, Unicode) kept."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exlcli.text.terminal_safe import TerminalFilter, terminal_safe

ATTACKS = {
    "osc52 clipboard, BEL": "\x1b]52;c;ZWNobyBwd25lZA==\x07",
    "osc52 clipboard, ST": "\x1b]52;c;ZWNobyBwd25lZA==\x1b\\",
    "osc0 title": "\x1b]0;you have been hacked\x07",
    "osc8 link": "\x1b]8;;http://evil.example\x1b\\",
    "csi clear screen": "\x1b[2J\x1b[H",
    "csi colour": "\x1b[31;1m",
    "csi private mode": "\x1b[?1049h",
    "dcs": "\x1bPq#0;2;0;0;0\x1b\\",
    "apc": "\x1b_Gf=100;AAAA\x1b\\",
    "8-bit csi": "\x9b2J",
    "8-bit osc": "\x9d52;c;ZWNobw==\x9c",
    "esc c reset": "\x1bc",
    "esc charset": "\x1b(0",
    "cursor save": "\x1b7",
}


@pytest.mark.parametrize("attack", list(ATTACKS.values()), ids=list(ATTACKS))
def test_each_control_sequence_is_dropped_whole_and_the_text_around_it_kept(attack):
    assert terminal_safe(f"before {attack}after") == "before after"


def test_every_c0_c1_and_del_is_dropped_but_newline_and_tab():
    for code in [*range(0x20), 0x7F, *range(0x80, 0xA0)]:
        ch = chr(code)
        expected = ch if ch in "\n\t" else ""
        assert terminal_safe(ch) == expected, hex(code)
        if ch not in "\x1b\x90\x98\x9b\x9d\x9e\x9f":  # those start a sequence that takes what follows
            assert terminal_safe(f"a{ch}b") == f"a{expected}b", hex(code)


def test_plain_text_passes_unchanged():
    text = "Hello,\tworld!\n```python\nprint('ünïcödé 😀 – ok')\n```\n| a | b |\n"
    assert terminal_safe(text) is text


def test_an_unterminated_sequence_at_the_end_is_dropped():
    assert terminal_safe("ok \x1b]52;c;AAAA") == "ok "
    assert terminal_safe("ok \x1b[1;2") == "ok "
    assert terminal_safe("ok \x1b") == "ok "


PIECES = st.lists(st.sampled_from(list(ATTACKS.values()) + ["x", "y z", "\n", "\t", "é", "\x1b", "[", "]", "\\",
                                                            "\x07", "2J", ";", "\x9c", "\r", "m"]), max_size=30)


@settings(max_examples=400, deadline=None)
@given(PIECES, st.lists(st.integers(min_value=0, max_value=400), max_size=8))
def test_streamed_in_any_pieces_it_equals_the_whole_text_cleaned(pieces, cuts):
    text = "".join(pieces)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    stream = TerminalFilter()
    out = "".join(stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])) + stream.flush()
    assert out == terminal_safe(text)
    assert not any(ord(ch) < 0x20 and ch not in "\n\t" or 0x7F <= ord(ch) <= 0x9F for ch in out)


def test_a_sequence_cut_between_two_pieces_never_leaks_a_part():
    stream = TerminalFilter()
    assert stream.feed("answer \x1b]52;c;ZWNo") == "answer "
    assert stream.feed("bw==\x07 done \x1b[") == " done "
    assert stream.feed("2J!") == "!"


def test_off_for_a_stream_that_is_not_a_terminal():
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert TerminalFilter.for_stream(io.StringIO()).feed("\x1b[2J") == "\x1b[2J"  # a file gets exact bytes
    assert TerminalFilter.for_stream(Tty()).feed("\x1b[2J") == ""
