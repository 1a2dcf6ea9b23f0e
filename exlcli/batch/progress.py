"""Progress on stderr: a Rich bar on a terminal, plain periodic lines otherwise. stdout is untouched."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO


@dataclass
class Snapshot:
    done: int  # result lines written this run (good + error)
    errors: int
    total: int  # lines this run expects to handle
    completion_tokens: int
    in_flight: int
    batch_size: int  # the engine's current batch (all clients), 0 if unknown
    elapsed: float

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        left = max(0, self.total - self.done)
        if left == 0:
            return 0.0
        if self.done == 0 or self.elapsed <= 0:
            return None
        return left * self.elapsed / self.done


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def plain_line(snap: Snapshot) -> str:
    return (f"batch: {snap.done}/{snap.total} done, {snap.errors} errors, "
            f"{snap.tokens_per_s:.1f} tok/s, eta {format_duration(snap.eta_s)}, "
            f"{snap.in_flight} in flight, batch size {snap.batch_size}")


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
            print(plain_line(snap), file=self.stream, flush=True)

    def message(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        pass


class RichProgress:
    """A live bar: done/total, output tok/s, ETA, in flight and the engine's batch size."""

    def __init__(self, stream: TextIO, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn

        self.console = Console(file=stream)
        self._progress = Progress(
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
        self._progress.update(self._task, completed=snap.done, total=max(snap.total, snap.done, 1),
                              errors=snap.errors, tps=snap.tokens_per_s, eta=format_duration(snap.eta_s),
                              in_flight=snap.in_flight, batch=snap.batch_size)

    def message(self, text: str) -> None:
        self._progress.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        self._progress.stop()


def make_progress(total: int, stream: TextIO | None = None, interval: float = 10.0):
    stream = stream or sys.stderr
    if stream.isatty():
        return RichProgress(stream, total)
    return PlainProgress(stream, interval)
