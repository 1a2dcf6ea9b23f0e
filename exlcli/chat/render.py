"""Showing one answer as it streams, and the stats line under it.

On a terminal the answer is rendered as Markdown while it streams (code blocks highlighted), in a
live area at most a screen tall: lines that scroll above it are printed for good, so a long answer
never duplicates or gets cropped. Off a terminal the text is written as it comes, nothing else.

Both ways the answer passes text.terminal_safe first: a model's text may hold escape sequences (a
clipboard write, a window title, a cleared screen) and none may reach the terminal; the styling
is Rich's, added after.

A model that thinks (Qwen3's <think>, gpt-oss's analysis channel) has its reasoning split off its
answer (text/reasoning.py) and shown dimmed above it, or folded to one line (`/think off`).
"""

from __future__ import annotations

import time

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.markdown import Markdown
from rich.segment import Segment
from rich.spinner import Spinner
from rich.text import Text

from exlcli.chat.io import ChatIO
from exlcli.client.base import Usage
from exlcli.text.reasoning import ReasoningSplitter, reasoning_splitter
from exlcli.text.terminal_safe import TerminalFilter, terminal_safe

REFRESH_INTERVAL = 1 / 20  # seconds between live redraws while tokens arrive


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def stats_line(usage: Usage | None, finish_reason: str | None, max_tokens: int | None = None,
               context_length: int | None = None) -> str:
    """'12 prompt tokens (8 cached), first token 45 ms, 34 tokens at 56.2 tok/s'; an answer that
    ended short of `max_tokens` with "length" ended at the end of the context, and says so."""
    if usage is None:
        text = "no usage reported"
    else:
        text = (f"{usage.prompt_tokens} prompt tokens ({usage.cached_tokens} cached), "
                f"first token {format_seconds(usage.ttft)}, "
                f"{usage.completion_tokens} tokens at {usage.decode_tps:.1f} tok/s")
        if usage.evicted_tokens:  # the window overflowed and shifted (context_overflow shift / sinks)
            text += f", {usage.evicted_tokens} tokens left the window"
    if finish_reason == "length" and usage is not None and max_tokens and usage.completion_tokens < max_tokens:
        text += f", stopped at the end of the context ({context_length} tokens)"
    elif finish_reason == "length":
        text += ", stopped at max_tokens"
    elif finish_reason == "cancelled":
        text += ", stopped"
    return text


def _trim_padding(line: list[Segment]) -> list[Segment]:
    """Drop the spaces Rich pads a line with (unless they are painted, as in a code block), so
    text copied from the terminal has no trailing blanks."""
    line = list(line)
    while line and not line[-1].control and not line[-1].text.strip() and not (
            line[-1].style and line[-1].style.bgcolor):
        line.pop()
    if line and not line[-1].control and not (line[-1].style and line[-1].style.bgcolor):
        last = line[-1]
        line[-1] = Segment(last.text.rstrip(" "), last.style)
    return line


class _Lines:
    """Already rendered lines, as a renderable. Printed, it must end its own last line (Rich adds
    no newline after a custom renderable); in the live area it must not (that adds a blank line)."""

    def __init__(self, lines: list[list[Segment]], end_with_newline: bool) -> None:
        self.lines = lines
        self.end_with_newline = end_with_newline

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for i, line in enumerate(self.lines):
            yield from line
            if self.end_with_newline or i + 1 < len(self.lines):
                yield Segment.line()


class _Thinking:
    """An answer's text split as it comes: the reasoning and the answer proper."""

    def __init__(self, splitter: ReasoningSplitter | None) -> None:
        self.splitter = splitter or reasoning_splitter(None)
        self.text = ""  # as the model wrote it, markup included
        self.reasoning = ""
        self.answer = ""

    def take(self, text: str) -> tuple[str, str]:
        self.text += text
        reasoning, answer = self.splitter.feed(text)
        self.reasoning += reasoning
        self.answer += answer
        return reasoning, answer

    def end(self) -> tuple[str, str]:
        reasoning, answer = self.splitter.finish()
        self.reasoning += reasoning
        self.answer += answer
        return reasoning, answer


def folded_line(reasoning: str) -> str:
    return f"▸ thought for {len(reasoning.split())} words (/think on shows the reasoning)"


class LiveAnswer(_Thinking):
    """Markdown rendered live; lines that leave the live area are committed above it."""

    def __init__(self, console: Console, splitter: ReasoningSplitter | None = None,
                 show_thinking: bool = True) -> None:
        super().__init__(splitter)
        self.console = console
        self.show_thinking = show_thinking
        self._committed = 0  # rendered lines already printed for good
        self._last_draw = 0.0
        self._drawn = 0  # len(text) at the last draw
        self._live = Live(Spinner("dots", text=Text("thinking", style="dim")), console=console,
                          auto_refresh=False, transient=False, vertical_overflow="visible")
        self._live.start()

    def _window(self) -> int:
        return max(4, self.console.height - 3)

    def feed(self, text: str) -> None:
        self.take(text)
        now = time.monotonic()
        if now - self._last_draw >= REFRESH_INTERVAL:
            self._draw()
            self._last_draw = now

    def tick(self) -> None:
        """Called while waiting: animate the spinner before the first token, or draw what the
        throttle held back."""
        if not self.text:
            self._live.refresh()
        elif self._drawn < len(self.text):
            self._draw()

    def _renderable(self) -> RenderableType:
        answer = Markdown(terminal_safe(self.answer))
        if not self.reasoning.strip():
            return answer
        thought = (Text(terminal_safe(self.reasoning.strip()), style="dim italic") if self.show_thinking
                   else Text(folded_line(self.reasoning), style="dim"))
        return Group(thought, Text(""), answer) if self.answer else thought

    def _draw(self, final: bool = False) -> None:
        self._drawn = len(self.text)
        lines = [_trim_padding(line) for line in
                 self.console.render_lines(self._renderable(), self.console.options, pad=False)]
        keep = 0 if final else self._window()
        split = max(self._committed, len(lines) - keep)
        if split > self._committed:  # printed above the live area, for good
            self._live.console.print(_Lines(lines[self._committed:split], end_with_newline=True))
            self._committed = split
        self._live.update(_Lines(lines[split:], end_with_newline=False), refresh=True)

    def finish(self) -> None:
        """Print the whole answer for good and close the live area."""
        try:
            self.end()
            self._draw(final=True)
        finally:
            self._live.stop()


class PlainAnswer(_Thinking):
    """The answer as it comes; the reasoning before it (when shown), a blank line between."""

    def __init__(self, io: ChatIO, splitter: ReasoningSplitter | None = None, show_thinking: bool = True) -> None:
        super().__init__(splitter)
        self.io = io
        self.show_thinking = show_thinking
        self._safe = TerminalFilter()  # plain output is read by people too, often on a terminal
        self._thought = False  # reasoning was written: a blank line goes before the answer
        self._newlines = 0  # newlines the written reasoning ends with

    def feed(self, text: str) -> None:
        self._write(*self.take(text))

    def _write(self, reasoning: str, answer: str) -> None:
        if reasoning and self.show_thinking:
            if not self._thought:
                reasoning = reasoning.lstrip()
            self._thought = self._thought or bool(reasoning)
            self._newlines = len(reasoning) - len(reasoning.rstrip("\n")) if reasoning.strip() else \
                self._newlines + reasoning.count("\n")
            self.io.write_answer(self._safe.feed(reasoning))
        if answer:
            if self._thought:  # a blank line between, however the reasoning ended
                answer, self._thought = "\n" * max(0, 2 - self._newlines) + answer, False
            self.io.write_answer(self._safe.feed(answer))

    def tick(self) -> None:
        pass

    def finish(self) -> None:
        self._write(*self.end())
        self.io.write_answer(self._safe.flush() + "\n")


def answer_view(io: ChatIO, splitter: ReasoningSplitter | None = None,
                show_thinking: bool = True) -> "LiveAnswer | PlainAnswer":
    if io.interactive:
        return LiveAnswer(io.out, splitter, show_thinking)
    return PlainAnswer(io, splitter, show_thinking)
