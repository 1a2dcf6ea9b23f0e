"""Rates that fall to 0 when the engine is idle.

The engine updates `EngineStats.tokens_per_s` and `last_batch_size` only when it steps, so an idle
engine keeps reporting its last busy values. The server computes its own from the engine's
monotonic counters instead, sampled whenever the display or a /metrics scrape looks: over the last
`window_s` seconds (the counter's value at the window's start interpolated between looks), or since
the previous look when looks are further apart. No steps in the
window: batch size 0. The caller passes the time, so tests drive a fake clock.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from exlcli.engine.stats import EngineStats

WINDOW_S = 5.0
HISTORY_LEN = 60  # sparkline points
HISTORY_EVERY_S = 1.0


class CounterRate:
    """Per-second rate of a monotonic counter over the last `window_s` seconds."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, float]] = collections.deque()

    def update(self, now: float, value: float) -> float:
        if self._samples and now < self._samples[-1][0]:
            self._samples.clear()  # the clock went back
        if self._samples and value < self._samples[-1][1]:
            # A reset, or a request moving from `active` to the totals between two reads of the
            # engine: count the drop as no change rather than as a negative rate.
            drop = self._samples[-1][1] - value
            self._samples = collections.deque((t, v - drop) for t, v in self._samples)
        self._samples.append((now, value))
        # Keep one sample at or before the window's start; the counter's value at the start is
        # read off the line between it and the next sample.
        start = now - self.window_s
        while len(self._samples) > 2 and self._samples[1][0] <= start:
            self._samples.popleft()
        (t0, v0), (t1, v1) = self._samples[0], self._samples[min(1, len(self._samples) - 1)]
        if t0 < start < t1:
            t0, v0 = start, v0 + (v1 - v0) * (start - t0) / (t1 - t0)
        return (value - v0) / (now - t0) if now > t0 else 0.0


@dataclass
class RatesView:
    generation_tokens_per_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    batch_size: int = 0  # sequences in the last step, 0 if the engine did not step in the window
    step_tokens: int = 0
    step_time_s: float | None = None  # None: no step in the window


class EngineRates:
    """Touched only from the event loop thread. Keeps a short history of generated tok/s."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self._generated = CounterRate(window_s)
        self._prompt = CounterRate(window_s)
        self._steps = CounterRate(window_s)
        self.history: collections.deque[float] = collections.deque(maxlen=HISTORY_LEN)
        self._history_at: float | None = None
        self.last = RatesView()

    def observe(self, stats: EngineStats, now: float) -> RatesView:
        # The engine adds a request's tokens to its totals when it finishes; the running ones count
        # in `active` until then.
        generated = self._generated.update(now, stats.total_generated_tokens
                                           + sum(a.generated_tokens for a in stats.active))
        prompt = self._prompt.update(now, stats.total_prompt_tokens)
        stepping = self._steps.update(now, stats.num_steps) > 0 or stats.num_running > 0
        self.last = RatesView(
            generation_tokens_per_s=generated, prompt_tokens_per_s=prompt,
            batch_size=stats.last_batch_size if stepping else 0,
            step_tokens=stats.last_step_tokens if stepping else 0,
            step_time_s=stats.last_step_time_s if stepping and stats.num_steps else None)
        if self._history_at is None or now - self._history_at >= HISTORY_EVERY_S:
            self._history_at = now
            self.history.append(generated)
        return self.last
