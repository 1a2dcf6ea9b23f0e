"""The server's own view of the generations it runs: the live display's rows, the queue depth that
admission control uses, and the latency figures /metrics exports.

It works with any EngineClient (the FakeClient in tests has no per-request engine view); when the
engine does report a request in `EngineStats.active`, its state and prompt size fill in the row.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Callable

from exlcli.client.base import TextDelta
from exlcli.engine.stats import ActiveRequestInfo, EngineStats

# Upper bounds (seconds) of the time-to-first-token and request-latency histograms; then +Inf.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
NUM_RECENT = 8


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last is +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.total += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass
class Generation:
    """One engine stream started by the server (a request with n=3 makes three)."""

    gen_id: str
    client: str
    priority: str
    endpoint: str
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    generated_tokens: int = 0
    prompt_tokens: int | None = None
    engine_state: str | None = None  # from EngineStats.active when the engine reports it

    @property
    def state(self) -> str:
        if self.engine_state:
            return self.engine_state
        return "waiting" if self.first_token_at is None else "decode"

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
    finished_at: float = field(default_factory=time.time)


class RequestTracker:
    """Touched only from the event loop thread, so it needs no lock."""

    def __init__(self, on_finish: Callable[[FinishedGeneration], None] | None = None) -> None:
        self.live: dict[str, Generation] = {}
        self.recent: collections.deque[FinishedGeneration] = collections.deque(maxlen=NUM_RECENT)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.finished_by_reason: collections.Counter[str] = collections.Counter()
        self.rejected_by_reason: collections.Counter[str] = collections.Counter()
        self.responses_by_status: collections.Counter[tuple[str, int]] = collections.Counter()
        self.on_finish = on_finish

    # ---- lifecycle of one generation ----

    def start(self, gen_id: str, client: str, priority: str, endpoint: str) -> Generation:
        gen = Generation(gen_id, client, priority, endpoint)
        self.live[gen_id] = gen
        return gen

    def on_delta(self, gen: Generation, delta: TextDelta) -> None:
        if (delta.text or delta.token_ids) and gen.first_token_at is None:
            gen.first_token_at = time.monotonic()
        gen.generated_tokens += len(delta.token_ids)
        if delta.finished:
            self.finish(gen, delta)

    def finish(self, gen: Generation, last: TextDelta | None, reason: str | None = None) -> None:
        if self.live.pop(gen.gen_id, None) is None:
            return  # already finished
        now = time.monotonic()
        usage = last.usage if last is not None else None
        reason = reason or (last.finish_reason if last is not None else None) or "cancelled"
        ttft = usage.ttft if usage is not None and usage.ttft is not None else (
            gen.first_token_at - gen.started if gen.first_token_at is not None else None)
        if ttft is not None:
            self.ttft.observe(ttft)
        self.latency.observe(now - gen.started)
        self.finished_by_reason[reason] += 1
        done = FinishedGeneration(
            gen.gen_id, gen.client, reason,
            prompt_tokens=usage.prompt_tokens if usage is not None else (gen.prompt_tokens or 0),
            generated_tokens=usage.completion_tokens if usage is not None else gen.generated_tokens,
            ttft_s=ttft, total_s=usage.total_time if usage is not None and usage.total_time > 0 else now - gen.started)
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
