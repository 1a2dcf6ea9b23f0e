"""A log filter that keeps the log readable when one line repeats by the thousand (a flood of
accept errors, bad requests or refused connections): the first few of each line per interval pass,
the rest are counted and reported once when the interval ends."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable


class RepeatLimiter(logging.Filter):
    def __init__(self, per_interval: int = 5, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.per_interval = per_interval
        self.interval_s = interval_s
        self.clock = clock
        self._window: dict[tuple[str, object], tuple[float, int]] = {}  # (logger, message) -> (start, count)

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.msg)  # the format string: "%d connections ..." repeats with new numbers
        now = self.clock()
        start, count = self._window.get(key, (now, 0))
        if now - start >= self.interval_s:
            if count > self.per_interval:
                record.msg = f"{record.msg} [and {count - self.per_interval} more like it in the last " \
                             f"{now - start:.0f} s]"
            start, count = now, 0
        count += 1
        self._window[key] = (start, count)
        if len(self._window) > 1024:  # many different lines: forget the oldest windows
            for old in sorted(self._window, key=lambda k: self._window[k][0])[:512]:
                del self._window[old]
        return count <= self.per_interval


class DropCancelledTracebacks(logging.Filter):
    """uvicorn logs "Exception in ASGI application" with a traceback for each stream it cancels
    when the drain timeout ends; that is the intended end of those streams, said once by uvicorn's
    "Cancel N running task(s)" line, not a crash."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))
