"""The chat's terminal: one object owning the input (prompt-toolkit on a terminal, plain lines
otherwise) and the Rich consoles for answers (stdout) and everything else (stderr).

Everything is injectable, so tests drive the chat with scripted input and read the transcript.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Callable, TextIO

from rich.console import Console, RenderableType
from rich.text import Text

from exlcli.chat.paths import history_path
from exlcli.text.terminal_safe import terminal_safe

PROMPT = ">>> "
CONTINUATION = "... "
BLOCK_QUOTE = '"""'
NEWLINE_KEY = "Alt-Enter (or Esc then Enter)"


def _isatty(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):
        return False


def read_block(first: str, next_line: Callable[[], str | None]) -> str:
    """A `\"\"\"` block as in ollama: text from the opening quotes to the line ending in closing ones.
    `next_line` returns None at end of input, which ends the block too."""
    body = first.lstrip()[len(BLOCK_QUOTE):]
    if body.rstrip().endswith(BLOCK_QUOTE) and body.strip() != "":
        return body.rstrip()[:-len(BLOCK_QUOTE)].strip()
    parts = [body] if body.strip() else []
    while True:
        line = next_line()
        if line is None:
            break
        if line.rstrip().endswith(BLOCK_QUOTE):
            parts.append(line.rstrip()[:-len(BLOCK_QUOTE)])
            break
        parts.append(line)
    return "\n".join(parts).strip("\n")


class ChatIO:
    """Reads messages and owns the two consoles.

    interactive: prompt-toolkit input with history, live display and colour (unless NO_COLOR);
    otherwise one message per input line (or a `\"\"\"` block), plain text, no escape codes.
    """

    def __init__(self, *, stdin: TextIO | None = None, stdout: TextIO | None = None,
                 stderr: TextIO | None = None, interactive: bool | None = None,
                 color: bool | None = None, width: int | None = None, height: int | None = None,
                 history_file: Path | None | bool = True, pt_input=None, pt_output=None) -> None:
        self.stdin = stdin if stdin is not None else sys.stdin
        self.stdout = stdout if stdout is not None else sys.stdout
        self.stderr = stderr if stderr is not None else sys.stderr
        if interactive is None:
            interactive = _isatty(self.stdin) and _isatty(self.stdout)
        self.interactive = interactive
        if color is None:
            color = interactive and not os.environ.get("NO_COLOR")
        self.color = color
        self.out = self._console(self.stdout, width, height)
        self.err = self._console(self.stderr, width, height)
        self._history_file = history_file
        self._pt_input = pt_input
        self._pt_output = pt_output
        self._session = None  # prompt-toolkit session, made on first read

    def _console(self, file: TextIO, width: int | None, height: int | None) -> Console:
        return Console(
            file=file, force_terminal=self.interactive, force_interactive=self.interactive,
            no_color=not self.color, color_system="auto" if self.color else None,
            width=width, height=height, highlight=False, emoji=False, markup=False,
            # Off a terminal, never insert line breaks into the text.
            soft_wrap=not self.interactive)

    # ---- output -------------------------------------------------------------------------------

    def say(self, message: RenderableType, style: str | None = None) -> None:
        """A line for the user that is not answer text: command output, notices (stderr). Text is made
        terminal-safe: it may quote a server's error or a saved conversation."""
        if isinstance(message, str):
            message = Text(terminal_safe(message), style=style or "")
        self.err.print(message)

    def notice(self, message: str) -> None:
        self.say(message, "dim")

    def error(self, message: str) -> None:
        self.say(f"error: {message}", "bold red")

    def write_answer(self, text: str) -> None:
        """Raw answer text to stdout, as it streams (plain mode)."""
        self.stdout.write(text)
        self.stdout.flush()

    @contextlib.contextmanager
    def quiet_keyboard(self):
        """While an answer streams, keys typed are not echoed (they would break the live display;
        they stay queued for the next prompt) and Ctrl-C is not shown as ^C. Ctrl-C still works."""
        try:
            import termios

            if not self.interactive:
                raise OSError("not a terminal")
            fd = self.stdin.fileno()
            saved = termios.tcgetattr(fd)
        except Exception:  # not a real terminal (tests, pipes) or no termios (Windows)
            yield
            return
        quiet = termios.tcgetattr(fd)
        quiet[3] &= ~(termios.ECHO | getattr(termios, "ECHOCTL", 0))  # [3] is the local-modes word
        try:
            termios.tcsetattr(fd, termios.TCSANOW, quiet)
            yield
        finally:
            termios.tcsetattr(fd, termios.TCSANOW, saved)

    # ---- input --------------------------------------------------------------------------------

    def read_message(self) -> str | None:
        """The next message or command; None when input ends (Ctrl-D); "" after Ctrl-C at the prompt."""
        if not self.interactive:
            line = self._plain_line()
            if line is None:
                return None
            return read_block(line, self._plain_line) if line.lstrip().startswith(BLOCK_QUOTE) else line.strip()
        try:
            line = self._prompt(PROMPT)
            if line.lstrip().startswith(BLOCK_QUOTE) and "\n" not in line:
                return read_block(line, self._continuation_line)
            return line.strip()
        except KeyboardInterrupt:
            return ""  # Ctrl-C at the prompt clears the line, as in a shell
        except EOFError:
            return None

    def _plain_line(self) -> str | None:
        line = self.stdin.readline()
        if line == "":
            return None
        return line.rstrip("\n").rstrip("\r")

    def _continuation_line(self) -> str | None:
        try:
            return self._prompt(CONTINUATION, placeholder="")
        except EOFError:
            return None

    def _prompt(self, message: str, **options) -> str:
        if self._session is None:
            self._session = self._make_session()
        return self._session.prompt(message, **options)

    def _make_session(self):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.auto_suggest import AutoSuggestFromHistory
        from prompt_toolkit.formatted_text import FormattedText
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings

        bindings = KeyBindings()

        @bindings.add("escape", "enter")  # Alt-Enter: terminals send it as Esc, Enter
        def _newline(event) -> None:
            event.current_buffer.insert_text("\n")

        history = InMemoryHistory()
        path = history_path() if self._history_file is True else self._history_file
        if path:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch(exist_ok=True)
                history = FileHistory(str(path))
            except OSError as e:
                self.notice(f"input history not saved: cannot write {path} ({e.strerror or e})")
        return PromptSession(
            history=history, key_bindings=bindings, multiline=False, auto_suggest=AutoSuggestFromHistory(),
            # "... " starts each new line of a multi-line message; a soft-wrapped line gets nothing.
            prompt_continuation=lambda width, line_number, wrap_count: "" if wrap_count else CONTINUATION.rjust(width),
            placeholder=FormattedText([("fg:ansibrightblack", "Send a message (/help for commands)")]),
            input=self._pt_input, output=self._pt_output, enable_suspend=True)
