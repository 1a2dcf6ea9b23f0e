"""Engine-wide statistics: feed the live display, `bench` and the server's /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

# Upper bounds (seconds) of the step-time histogram buckets; the last bucket is +Inf.
STEP_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass
class ActiveRequestInfo:
    request_id: str
    client: str  # chat / batch / bench / api
    state: str  # waiting / prefill / decode / preempted
    prompt_tokens: int
    generated_tokens: int
    tokens_per_s: float
    age_s: float
    evicted_tokens: int = 0  # left the cache by context shifts (this request's)
    window: int | None = None  # the request's window past which the cache shifts (None: it stops there)
    cache_tokens: int = 0  # tokens in its cache now


@dataclass
class FinishedRequestInfo:
    request_id: str
    client: str
    finish_reason: str
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float | None
    total_s: float


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    pages_total: int = 0
    pages_used: int = 0  # referenced by a live sequence
    pages_cached: int = 0  # held only by the prefix cache (reusable, evictable)
    # the KV cache's layer groups (model/kv_cache.py): each one's window ("full", or W in tokens)
    # and the pages its tables hold (a page holds one group's layers)
    page_group_windows: list[str] = field(default_factory=list)
    pages_used_by_group: list[int] = field(default_factory=list)
    page_size: int = 0
    kv_cache_type_k: str = ""  # K's and V's cache types (model/kv_cache.py): bf16, fp8, q8_0, q4h, ...
    kv_cache_type_v: str = ""
    last_batch_size: int = 0
    last_step_tokens: int = 0
    last_step_time_s: float = 0.0
    tokens_per_s: float = 0.0  # generated tokens per second over the recent window
    num_steps: int = 0
    step_time_sum_s: float = 0.0
    step_time_bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_TIME_BUCKETS) + 1))
    total_requests: int = 0  # finished, any reason
    total_prompt_tokens: int = 0
    total_generated_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens served from it
    prefix_cache_evictions: int = 0
    # speculative decoding: the drafter (None: off), the drafted tokens verified, those accepted,
    # and both by draft position
    spec_method: str | None = None
    spec_verify_steps: int = 0
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafted_by_position: list[int] = field(default_factory=list)
    spec_accepted_by_position: list[int] = field(default_factory=list)
    # failures (engine/failure_policy.py): steps that raised, requests ended with an error, of those
    # the ones whose logits were NaN or infinite
    step_failures: int = 0
    requests_failed: int = 0
    nonfinite_logits: int = 0
    prefill_tokens: int = 0  # prompt tokens computed: neither served by the prefix cache nor resumed
    # past the window (engine/context_window.py): the engine's default policy, and the tokens that
    # left the caches by context shifts (finished and running requests)
    context_overflow: str = "stop"
    sink_tokens: int = 4
    window: int = 0
    evicted_tokens: int = 0
    # continuations (engine/sessions.py): sessions parked and their pages; requests that resumed one,
    # and the tokens those did not compute again
    sessions_parked: int = 0
    session_pages: int = 0
    sessions_resumed: int = 0
    session_resumed_tokens: int = 0
    active: list[ActiveRequestInfo] = field(default_factory=list)
    recent_finished: list[FinishedRequestInfo] = field(default_factory=list)

    @property
    def pages_free(self) -> int:
        return self.pages_total - self.pages_used - self.pages_cached

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_drafted_tokens if self.spec_drafted_tokens else 0.0

    @property
    def spec_acceptance_by_position(self) -> list[float]:
        """Of the tokens drafted at position i (0: right after the last known token), the share accepted."""
        return [a / d for a, d in zip(self.spec_accepted_by_position, self.spec_drafted_by_position) if d]

    def spec_summary(self) -> str:
        """One line for `run --verbose` and the serve display: drafted, accepted, the rate by position."""
        if not self.spec_method:
            return "speculative off"
        if not self.spec_drafted_tokens:
            return f"speculative {self.spec_method}: nothing drafted"
        by_pos = " ".join(f"{100 * r:.0f}" for r in self.spec_acceptance_by_position)
        return (f"speculative {self.spec_method}: drafted {self.spec_drafted_tokens}, accepted "
                f"{self.spec_accepted_tokens} ({100 * self.spec_acceptance_rate:.0f}%), by position {by_pos} %, "
                f"{(self.spec_accepted_tokens + self.spec_verify_steps) / self.spec_verify_steps:.2f} tokens "
                f"per verify step")

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
