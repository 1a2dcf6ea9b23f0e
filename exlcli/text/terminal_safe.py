"""Model text made safe for a terminal: every control sequence and control character dropped.

A model's answer is untrusted text (a prompt injection can make it anything), and a terminal acts
on the escape sequences it receives: OSC 52 writes the clipboard, OSC 0 sets the window title,
CSI 2J clears the screen, OSC 8 makes links, DCS and APC talk to the terminal itself. So model text
reaches a terminal only through this module: whole sequences are dropped (ESC and 8-bit C1
introducers with their parameters and, for string sequences, their bodies up to the terminator),
and so is every other C0 and C1 control character except newline and tab. The colours and styles
exlcli shows are Rich's, added after this, so they stay.

`terminal_safe` cleans a whole text; `TerminalFilter` cleans a stream of pieces, holding back a
sequence cut between two pieces until it is complete, so that feeding any split of a text gives
exactly `terminal_safe` of the whole. An unterminated sequence at the end is dropped.
"""

from __future__ import annotations

import re
from typing import TextIO

# ESC ] (OSC), ESC P (DCS), ESC X (SOS), ESC ^ (PM), ESC _ (APC) and their 8-bit forms start a
# string that runs to BEL, ST (ESC \ or 0x9c), CAN or SUB; ESC or any C1 inside ends it too.
_STRING_START = r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])"
_STRING_BODY = r"[^\x07\x18\x1a\x1b\x80-\x9f]*"
_CSI_START = r"(?:\x1b\[|\x9b)"
_CSI_BODY = r"[0-?]*[ -/]*"  # parameter bytes, then intermediate bytes

_SEQUENCE = re.compile(
    f"{_STRING_START}{_STRING_BODY}(?:\\x07|\\x18|\\x1a|\\x1b\\\\|\\x9c)?"
    f"|{_CSI_START}{_CSI_BODY}[@-~]?"  # a CSI ends at its final byte; any other byte ends it early
    r"|\x1b[ -/]*[0-~]?"  # any other escape: ESC, intermediates, final byte
    r"|[\x00-\x08\x0b-\x1f\x7f-\x9f]"  # the rest of C0 (newline and tab kept), DEL and C1
)
# What may still grow into a longer sequence when more text comes (matched from its introducer).
_OPEN = re.compile(f"{_STRING_START}{_STRING_BODY}|{_CSI_START}{_CSI_BODY}|\\x1b[ -/]*")
_INTRODUCERS = "\x1b\x90\x98\x9b\x9d\x9e\x9f"
_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_safe(text: str) -> str:
    """`text` with every control sequence and control character but newline and tab removed."""
    if not _UNSAFE.search(text):  # the common case: nothing to do, at the speed of one scan
        return text
    return _SEQUENCE.sub("", text)


class TerminalFilter:
    """`terminal_safe` for text that arrives in pieces (a streamed answer)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # off: text passes as it is (output that is not a terminal)
        self._held = ""

    @classmethod
    def for_stream(cls, stream: TextIO) -> "TerminalFilter":
        """On when `stream` is a terminal; off for a file or a pipe, whose bytes stay exact."""
        try:
            tty = bool(stream.isatty())
        except (AttributeError, ValueError):
            tty = False
        return cls(enabled=tty)

    def feed(self, text: str) -> str:
        if not self.enabled:
            return text
        text = self._held + text
        self._held = ""
        start = max(text.rfind(c) for c in _INTRODUCERS)
        if start >= 0 and _OPEN.fullmatch(text, start):  # a sequence that may not be complete yet
            text, self._held = text[:start], text[start:]
        return terminal_safe(text)

    def flush(self) -> str:
        """The end of the stream: a sequence still open is dropped."""
        self._held = ""
        return ""
