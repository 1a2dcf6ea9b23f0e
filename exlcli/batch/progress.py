"""Progress on stderr: a Rich bar on a terminal, plain periodic lines otherwise. stdout is untouched.

Messages and the last error quote what a line or a server said, so they pass text.terminal_safe:
no control sequence from them reaches the terminal.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.text import Text

from exlcli.text.terminal_safe import terminal_safe


@dataclass
class Snapshot:
    done: int  # result lines written this run (good + error)
    errors: int
    total: int  # lines this run expects to handle
    completion_tokens: int  # of finished requests
    in_flight: int
    batch_size: int  # the engine's current batch (all clients), 0 if unknown
    elapsed: float
    instant_errors: int = 0  # of `errors`, lines that never reached the engine (unreadable, refused)
    streamed_tokens: int = 0  # tokens received so far, requests still in flight included
    last_error: str | None = None

    @property
    def tokens_per_s(self) -> float:
        tokens = max(self.streamed_tokens, self.completion_tokens)
        return tokens / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """From the lines the engine completed: an unreadable line costs no time, so counting it
        would make the rest look faster than it is."""
        left = max(0, self.total - self.done)
        if left == 0:
            return 0.0
        completed = self.done - self.instant_errors
        if completed <= 0 or self.elapsed <= 0:
            return None
        return left * self.elapsed / completed


class StreamedTokens:
    """Tokens received so far, added to by the threads that drain the streams."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0

    def add(self, count: int) -> None:
        if count:
            with self._lock:
                self._total += count

    @property
    def total(self) -> int:
        return self._total


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def plain_line(snap: Snapshot) -> str:
    line = (f"batch: {snap.done}/{snap.total} done, {snap.errors} errors, "
            f"{snap.tokens_per_s:.1f} tok/s, eta {format_duration(snap.eta_s)}, "
            f"{snap.in_flight} in flight, batch size {snap.batch_size}")
    return line + (f"; last error: {snap.last_error}" if snap.last_error else "")


class PlainProgress:
    """One line every `interval` seconds (for logs and pipes)."""

    def __init__(self, stream: TextIO, interval: float = 10.0) -> None:
        self.stream = stream
        self.interval = interval
        self._last = time.monotonic()

    def update(self, snap: Snapshot) -> None:
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            print(terminal_safe(plain_line(snap)), file=self.stream, flush=True)

    def message(self, text: str) -> None:
        print(terminal_safe(text), file=self.stream, flush=True)

    def close(self) -> None:
        pass


class BarWithLastError(Progress):
    """A bar with the last error line under it (Rich's way to add lines: override get_renderables)."""

    last_error: str | None = None

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        if self.last_error:
            yield Text(f"last error: {self.last_error}", style="red", no_wrap=True, overflow="ellipsis")


class RichProgress:
    """A live bar: done/total, errors, output tok/s, ETA, in flight and the engine's batch size;
    under it, the last error line."""

    def __init__(self, stream: TextIO, total: int) -> None:
        self.console = Console(file=stream)
        self._progress = BarWithLastError(
            TextColumn("[bold]batch"), BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[errors]} err"),
            TextColumn("{task.fields[tps]:.1f} tok/s"),
            TextColumn("eta {task.fields[eta]}"),
            TextColumn("{task.fields[in_flight]} in flight, batch {task.fields[batch]}"),
            console=self.console, transient=False, refresh_per_second=4,
        )
        self._task = self._progress.add_task("batch", total=max(total, 1), errors=0, tps=0.0, eta="?",
                                             in_flight=0, batch=0)
        self._progress.start()

    def update(self, snap: Snapshot) -> None:
        self._progress.last_error = terminal_safe(snap.last_error) if snap.last_error else None
        self._progress.update(self._task, completed=snap.done, total=max(snap.total, snap.done, 1),
                              errors=snap.errors, tps=snap.tokens_per_s, eta=format_duration(snap.eta_s),
                              in_flight=snap.in_flight, batch=snap.batch_size)

    def message(self, text: str) -> None:
        self._progress.console.print(terminal_safe(text), markup=False, highlight=False)

    def close(self) -> None:
        self._progress.stop()


def make_progress(total: int, stream: TextIO | None = None, interval: float = 10.0):
    stream = stream or sys.stderr
    if stream.isatty():
        return RichProgress(stream, total)
    return PlainProgress(stream, interval)
