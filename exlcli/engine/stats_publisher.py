"""The engine's statistics (stats.py's `EngineStats`): counters the engine's thread updates after
every step and every finished request, and the snapshot any thread reads (live display, `bench`,
the server's /metrics)."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import TYPE_CHECKING

from exlcli.engine.sequence import SeqStatus
from exlcli.engine.stats import STEP_TIME_BUCKETS, ActiveRequestInfo, EngineStats, FinishedRequestInfo

if TYPE_CHECKING:
    from exlcli.engine.failure_policy import FailurePolicy
    from exlcli.engine.page_pool import PagePool
    from exlcli.engine.request import FinishReason, RequestStats
    from exlcli.engine.scheduler import ScheduledBatch, Scheduler
    from exlcli.engine.sequence import Sequence
    from exlcli.engine.sessions import SessionCache
    from exlcli.engine.speculative import Speculator

_RECENT_FINISHED = 20  # finished requests the snapshot lists
_RATE_WINDOW_S = 5.0  # tokens_per_s is the rate over this window


class StatsPublisher:
    def __init__(self, stats: EngineStats, scheduler: Scheduler, pool: PagePool, sessions: SessionCache,
                 speculator: Speculator | None, failures: FailurePolicy) -> None:
        self._stats = stats
        self._scheduler = scheduler
        self._pool = pool
        self._sessions = sessions
        self._speculator = speculator
        self._failures = failures
        self._lock = threading.Lock()  # the engine's thread writes _stats, any thread snapshots it
        self._recent_tokens: collections.deque[tuple[float, int]] = collections.deque()
        self._recent_token_total = 0  # the sum of _recent_tokens' counts (kept, not summed every step)
        self._num_prefill_tokens = 0  # prompt tokens computed (neither cached nor resumed)
        self._num_evicted_finished = 0  # tokens finished requests evicted

    def count_prefill(self, batch: ScheduledBatch) -> None:
        """Adds the prompt tokens `batch` computes (a decode row has none); called before it is
        committed."""
        for item in batch.items:
            seq = item.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self._num_prefill_tokens += (min(seq.num_computed_tokens + item.num_new_tokens, seq.num_prompt_tokens)
                                             - seq.num_computed_tokens)

    def record_finished(self, seq: Sequence, reason: FinishReason, stats: RequestStats) -> None:
        """Called once `seq` is out of the scheduler and its pages are freed or parked: the gauges
        are set here too, so they are exact as soon as a request ends, even one that a failure ends
        on an engine that then steps no more (idle, on its own thread)."""
        with self._lock:
            s = self._stats
            self._set_gauges(s)
            s.total_requests += 1
            s.total_prompt_tokens += stats.prompt_tokens
            s.total_generated_tokens += stats.generated_tokens
            self._num_evicted_finished += stats.evicted_tokens
            s.recent_finished = (s.recent_finished + [FinishedRequestInfo(
                seq.request_id, seq.request.client, reason.value, stats.prompt_tokens,
                stats.generated_tokens, stats.ttft, stats.total_time)])[-_RECENT_FINISHED:]

    def publish(self, batch: ScheduledBatch | None, elapsed: float, generated: int = 0) -> None:
        """Per-step counters only: cheap enough for every step."""
        now = time.perf_counter()
        if generated:
            self._recent_tokens.append((now, generated))
            self._recent_token_total += generated
        while self._recent_tokens and now - self._recent_tokens[0][0] > _RATE_WINDOW_S:
            self._recent_token_total -= self._recent_tokens.popleft()[1]
        window = now - self._recent_tokens[0][0] if len(self._recent_tokens) > 1 else 0.0
        sched, pool, sessions = self._scheduler, self._pool, self._sessions
        with self._lock:
            s = self._stats
            self._set_gauges(s)
            # (empty after 5 s without a token: a prefill step then generates none)
            recent = self._recent_token_total - self._recent_tokens[0][1] if self._recent_tokens else 0
            s.tokens_per_s = recent / window if window > 0 else 0.0
            s.num_preemptions = sched.num_preemptions
            s.prefix_cache_queries, s.prefix_cache_hits = sched.prefix_queries, sched.prefix_hits
            s.prefix_cache_evictions = pool.num_evictions
            s.prefill_tokens, s.evicted_tokens = self._num_prefill_tokens, self._num_evicted_finished
            s.sessions_resumed, s.session_resumed_tokens = sessions.num_resumed, sessions.num_resumed_tokens
            if self._speculator is not None:
                c = self._speculator.counters
                s.spec_verify_steps, s.spec_drafted_tokens, s.spec_accepted_tokens = (
                    c.num_verify_steps, c.num_drafted, c.num_accepted)
                s.spec_drafted_by_position = list(c.drafted_by_position)
                s.spec_accepted_by_position = list(c.accepted_by_position)
            if batch is not None and batch.items:
                s.last_batch_size, s.last_step_tokens = len(batch.items), batch.num_tokens
                s.last_step_time_s = elapsed
                s.num_steps += 1
                s.step_time_sum_s += elapsed
                bucket = next((i for i, b in enumerate(STEP_TIME_BUCKETS) if elapsed <= b), len(STEP_TIME_BUCKETS))
                s.step_time_bucket_counts[bucket] += 1

    def _set_gauges(self, s: EngineStats) -> None:
        """What is in the engine now: requests running and waiting, pages used, parked sessions."""
        sched, pool, sessions = self._scheduler, self._pool, self._sessions
        s.num_running, s.num_waiting = len(sched.running), len(sched.waiting)
        s.pages_used, s.pages_cached = pool.num_used, pool.num_cached
        s.pages_used_by_group = list(pool.used_by_group)
        s.sessions_parked, s.session_pages = len(sessions), sessions.num_pages

    def snapshot(self) -> EngineStats:
        """A copy: the engine's thread goes on updating its own."""
        with self._lock:
            snap = dataclasses.replace(self._stats, step_time_bucket_counts=list(self._stats.step_time_bucket_counts),
                                       recent_finished=list(self._stats.recent_finished),
                                       spec_drafted_by_position=list(self._stats.spec_drafted_by_position),
                                       spec_accepted_by_position=list(self._stats.spec_accepted_by_position),
                                       pages_used_by_group=list(self._stats.pages_used_by_group))
        snap.active = self._active_requests()
        snap.evicted_tokens = snap.evicted_tokens + sum(a.evicted_tokens for a in snap.active)
        c = self._failures.counters
        snap.step_failures, snap.requests_failed, snap.nonfinite_logits = (
            c.step_failures, c.requests_failed, c.nonfinite_logits)
        return snap

    def last_step_shape(self) -> tuple[int, int]:
        with self._lock:
            return self._stats.last_batch_size, self._stats.last_step_tokens

    def _active_requests(self) -> list[ActiveRequestInfo]:
        """Rows for the live display; built when asked for, not every step (copies of the lists
        are safe to read from another thread)."""
        now = time.perf_counter()
        active = []
        for seq in list(self._scheduler.running) + list(self._scheduler.waiting):
            waiting = seq.status is SeqStatus.WAITING
            state = ("preempted" if waiting and seq.num_preemptions else "waiting" if waiting
                     else "prefill" if seq.num_computed_tokens < seq.num_prompt_tokens else "decode")
            gen_time = now - seq.first_token_time if seq.first_token_time else 0.0
            active.append(ActiveRequestInfo(seq.request_id, seq.request.client, state, seq.num_prompt_tokens,
                                            seq.num_generated,
                                            (seq.num_generated - 1) / gen_time if gen_time > 0 else 0.0,
                                            now - seq.submit_time, evicted_tokens=seq.num_evicted - seq.evicted_before,
                                            window=seq.overflow.window if seq.overflow is not None else None,
                                            cache_tokens=seq.cache_len))
        return active
