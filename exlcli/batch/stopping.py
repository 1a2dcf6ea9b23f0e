"""Ctrl-C and SIGTERM for a batch job: handlers only set flags; the loop reads them and reports.

First Ctrl-C: stop submitting, let what is in flight finish and be written. Second Ctrl-C, or
SIGTERM (a service manager wants the process gone soon): cancel what is in flight too.

Before the loop runs (the model loading), there is nothing to finish: `sigterm_raises` turns a
SIGTERM there into Terminated, so the CLI releases the output's lock and says so in one line with
the exit code of a terminated job, instead of dying silently by the signal.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


class StopControl:
    """Set by signals (or tests); read by the loop. Handlers only set flags: the loop prints."""

    def __init__(self) -> None:
        self.stopping = threading.Event()  # no new submissions
        self.cancelling = threading.Event()  # cancel what is in flight
        self.signal_name: str | None = None

    def request(self, cancel: bool = False, signal_name: str | None = None) -> None:
        if signal_name and not self.signal_name:
            self.signal_name = signal_name
        if self.stopping.is_set() or cancel:
            self.cancelling.set()
        self.stopping.set()

    def _on_signal(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        self.request(cancel=(name == "SIGTERM"), signal_name=name)

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopControl"]:
        """SIGINT / SIGTERM set the flags while inside (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


class Terminated(BaseException):
    """SIGTERM arrived while nothing could be stopped gracefully (the model loading). A
    BaseException, as KeyboardInterrupt is: no `except Exception` on the way swallows it."""


def _raise_terminated(_signum: int, _frame: object) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside, SIGTERM raises Terminated in the main thread (elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def terminable(load: Callable[..., T], *args: object, **kwargs: object) -> T:
    """`load(*args, **kwargs)` (opening the engine: the model loads) with SIGTERM raising Terminated."""
    with sigterm_raises():
        return load(*args, **kwargs)
