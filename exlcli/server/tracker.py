"""The server's own view of the generations it runs: the live display's rows, the queue depth that
admission control uses, and the latency figures /metrics exports and the display summarises.

It works with any EngineClient (the FakeClient in tests has no per-request engine view); when the
engine does report a request in `EngineStats.active`, its state and prompt size fill in the row.

Latencies go two ways: into prometheus_client histograms (vLLM's names, in this tracker's own
registry: one per app, none global) and into one-minute windows for the display's percentiles.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client import Histogram as PromHistogram

from exlcli.client.base import TextDelta
from exlcli.engine.stats import ActiveRequestInfo, EngineStats

# Upper bounds (seconds) of the histograms; then +Inf.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
NUM_RECENT = 8
RECENT_WINDOW_S = 60.0


class RecentSamples:
    """Values seen in the last `window_s` seconds, for percentiles."""

    def __init__(self, window_s: float = RECENT_WINDOW_S, max_len: int = 20_000) -> None:
        self.window_s = window_s
        self._items: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_len)

    def add(self, now: float, value: float) -> None:
        self._items.append((now, value))

    def values(self, now: float) -> list[float]:
        while self._items and self._items[0][0] < now - self.window_s:
            self._items.popleft()
        return [v for _, v in self._items]

    def percentile(self, q: float, now: float) -> float | None:
        """Nearest-rank percentile (q in 0..100), None when the window is empty."""
        values = sorted(self.values(now))
        if not values:
            return None
        return values[max(0, math.ceil(q / 100 * len(values)) - 1)]


@dataclass
class Generation:
    """One engine stream started by the server (a request with n=3 makes three)."""

    gen_id: str  # the engine's request id
    client: str
    priority: str
    endpoint: str
    started: float
    response_id: str | None = None  # what the HTTP client sees (chatcmpl-...), shared by a request's choices
    choice: int | None = None  # the choice's index when the response has several
    first_token_at: float | None = None
    last_token_at: float | None = None
    generated_tokens: int = 0
    prompt_tokens: int | None = None
    engine_state: str | None = None  # from EngineStats.active when the engine reports it

    @property
    def display_id(self) -> str:
        rid = self.response_id or self.gen_id
        return rid if self.choice is None else f"{rid}[{self.choice}]"

    @property
    def state(self) -> str:
        if self.engine_state:
            return self.engine_state
        return "waiting" if self.first_token_at is None else "decode"

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    def tokens_per_s(self, now: float) -> float:
        if self.first_token_at is None or self.generated_tokens < 2:
            return 0.0
        span = now - self.first_token_at
        return (self.generated_tokens - 1) / span if span > 0 else 0.0


@dataclass
class FinishedGeneration:
    gen_id: str
    client: str
    finish_reason: str
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float | None
    total_s: float
    display_id: str = ""
    priority: str = ""
    finished_at: float = field(default_factory=time.time)  # wall clock, for log lines


class RequestTracker:
    """Touched only from the event loop thread, so it needs no lock. `clock` (monotonic seconds)
    is injectable for tests."""

    def __init__(self, on_finish: Callable[[FinishedGeneration], None] | None = None, model_name: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.live: dict[str, Generation] = {}
        self.recent: collections.deque[FinishedGeneration] = collections.deque(maxlen=NUM_RECENT)
        self.finished_by_reason: collections.Counter[str] = collections.Counter()
        self.rejected_by_reason: collections.Counter[str] = collections.Counter()
        self.responses_by_status: collections.Counter[tuple[str, int]] = collections.Counter()
        self.on_finish = on_finish
        self.clock = clock
        self.recent_ttft = RecentSamples()
        self.recent_itl = RecentSamples()
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]):
            return PromHistogram(name, help_text, list(labels), registry=self.registry,
                                 buckets=buckets).labels(**labels)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Seconds from arrival to the first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Seconds between two generated tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Seconds from arrival to the last token.",
                             LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Seconds a request waited in the engine's queue before it was scheduled.",
                               TTFT_BUCKETS)

    # ---- lifecycle of one generation ----

    def start(self, gen_id: str, client: str, priority: str, endpoint: str, response_id: str | None = None,
              choice: int | None = None) -> Generation:
        gen = Generation(gen_id, client, priority, endpoint, self.clock(), response_id, choice)
        self.live[gen_id] = gen
        return gen

    def on_delta(self, gen: Generation, delta: TextDelta) -> None:
        now = self.clock()
        if (delta.text or delta.token_ids) and gen.first_token_at is None:
            gen.first_token_at = now
        elif delta.token_ids and gen.last_token_at is not None:
            per_token = (now - gen.last_token_at) / len(delta.token_ids)
            for _ in delta.token_ids:
                self.itl.observe(per_token)
            self.recent_itl.add(now, per_token)
        if delta.token_ids:
            gen.last_token_at = now
        gen.generated_tokens += len(delta.token_ids)
        if delta.finished:
            self.finish(gen, delta)

    def finish(self, gen: Generation, last: TextDelta | None, reason: str | None = None) -> None:
        if self.live.pop(gen.gen_id, None) is None:
            return  # already finished
        now = self.clock()
        usage = last.usage if last is not None else None
        reason = reason or (last.finish_reason if last is not None else None) or "cancelled"
        ttft = usage.ttft if usage is not None and usage.ttft is not None else gen.ttft_s
        if ttft is not None:
            self.ttft.observe(ttft)
            self.recent_ttft.add(now, ttft)
        if usage is not None:
            self.queue.observe(usage.queue_time)
        self.e2e.observe(now - gen.started)
        self.finished_by_reason[reason] += 1
        done = FinishedGeneration(
            gen.gen_id, gen.client, reason,
            prompt_tokens=usage.prompt_tokens if usage is not None else (gen.prompt_tokens or 0),
            generated_tokens=usage.completion_tokens if usage is not None else gen.generated_tokens,
            ttft_s=ttft, total_s=usage.total_time if usage is not None and usage.total_time > 0 else now - gen.started,
            display_id=gen.display_id, priority=gen.priority)
        self.recent.appendleft(done)
        if self.on_finish is not None:
            self.on_finish(done)

    # ---- views ----

    def merge_engine_view(self, active: list[ActiveRequestInfo]) -> None:
        by_id = {a.request_id: a for a in active}
        for gen in self.live.values():
            info = by_id.get(gen.gen_id)
            if info is not None:
                gen.engine_state = info.state
                gen.prompt_tokens = info.prompt_tokens

    def num_waiting(self, stats: EngineStats | None = None) -> int:
        """Generations with no token yet that the engine has not started on: the queue that
        --max-queue bounds. Without an engine view, every generation still without a token."""
        if stats is not None:
            self.merge_engine_view(stats.active)
        return sum(1 for g in self.live.values()
                   if g.first_token_at is None and g.state in ("waiting", "preempted"))

    def rows(self) -> list[Generation]:
        return sorted(self.live.values(), key=lambda g: g.started)

    def count_response(self, endpoint: str, status: int) -> None:
        self.responses_by_status[(endpoint, status)] += 1
