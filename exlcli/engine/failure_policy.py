"""What the engine does when a step fails: blame only the requests it can (a failed forward pass or
sampling is retried once with each sequence alone, see step_launch.py; a loop that keeps failing to
schedule schedules each sequence alone, see Engine._step_each_alone), end a request whose logits are
NaN or infinite, and never spin: a loop that makes no progress backs off, then isolates, and fails
only what is really stuck. Failures are counted (for /metrics) and logged at a readable rate: the
first of a kind with its traceback, then one summary line per interval."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass
class FailureCounters:
    step_failures: int = 0  # steps (or parts of steps) that raised
    requests_failed: int = 0  # requests the engine ended with finish_reason "error"
    nonfinite_logits: int = 0  # of those, ended because their logits were NaN or infinite


class FailureLog:
    """One traceback per kind of failure and interval; repeats are counted and summed up in the
    next line of that kind, so a persistent fault writes a few lines a minute, not thousands."""

    def __init__(self, log: logging.Logger, interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def failed(self, what: str, error: BaseException) -> None:
        now = self.clock()
        last = self._last.get(what)
        if last is not None and now - last < self.interval_s:
            self._suppressed[what] = self._suppressed.get(what, 0) + 1
            return
        self._last[what] = now
        repeats = self._suppressed.pop(what, 0)
        more = f" ({repeats} more like it in the last {now - last:.0f} s)" if repeats and last is not None else ""
        self.log.error("%s: %s: %s%s", what, type(error).__name__, error, more,
                       exc_info=(type(error), error, error.__traceback__) if not repeats else None)


class FailurePolicy:
    """The engine's failure bookkeeping: counters, the rate-limited log, the retry of a failed
    batch one sequence at a time, and the stall detector with its backoff."""

    def __init__(self, log: logging.Logger, max_stalled_steps: int = 5, base_delay_s: float = 0.01,
                 max_delay_s: float = 1.0, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.counters = FailureCounters()
        self.log = FailureLog(log, clock=clock)
        self.max_stalled_steps = max_stalled_steps
        self.base_delay_s = base_delay_s
        self.max_delay_s = max_delay_s
        self.sleep = sleep
        self.last_error: BaseException | None = None
        self._stalled = 0

    def step_failed(self, what: str, error: BaseException) -> None:
        self.counters.step_failures += 1
        self.last_error = error
        self.log.failed(what, error)

    def request_failed(self, nonfinite: bool = False) -> None:
        self.counters.requests_failed += 1
        self.counters.nonfinite_logits += nonfinite

    def progressed(self) -> None:
        """A step scheduled work: the loop is not stuck."""
        self._stalled = 0
        self.last_error = None

    def stalled(self) -> bool:
        """A step had work but scheduled nothing and had nothing in flight (schedule() raised, or
        every sequence waits on something no step will bring). Backs off; True once it has
        happened `max_stalled_steps` times in a row: the caller then schedules each sequence alone
        and fails those that fail alone, or what is left when none moves."""
        self._stalled += 1
        if self._stalled >= self.max_stalled_steps:
            self._stalled = 0
            return True
        self.sleep(min(self.max_delay_s, self.base_delay_s * 2 ** (self._stalled - 1)))
        return False

    def stall_message(self) -> str:
        cause = f" (last error: {type(self.last_error).__name__}: {self.last_error})" if self.last_error else ""
        return f"the engine could not make progress on this request{cause}"

    @staticmethod
    def run_alone(items: Sequence[Item], run: Callable[[Item], Result]
                  ) -> tuple[list[tuple[Item, Result]], list[tuple[Item, BaseException]]]:
        """After a step over `items` failed: run each alone, once. -> (those that ran with their
        results, in order; those that failed again with their errors)."""
        done: list[tuple[Item, Result]] = []
        failed: list[tuple[Item, BaseException]] = []
        for item in items:
            try:
                done.append((item, run(item)))
            except Exception as e:
                failed.append((item, e))
        return done, failed
