"""/metrics in the Prometheus text exposition format (version 0.0.4), from the engine's
EngineStats and the server's RequestTracker. Written by hand: a few dozen lines, no dependency."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exlcli.engine.stats import STEP_TIME_BUCKETS, EngineStats
from exlcli.server.tracker import Histogram, RequestTracker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "exlcli_"
# Paths counted by name in exlcli_http_responses_total; any other path counts as "other".
KNOWN_ENDPOINTS = {"/v1/models", "/v1/chat/completions", "/v1/completions", "/health", "/metrics",
                   "/tokenize", "/stats"}


def _number(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> str:
        full = PREFIX + name
        self.lines.append(f"# HELP {full} {help_text}")
        self.lines.append(f"# TYPE {full} {kind}")
        return full

    def sample(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        self.lines.append(f"{name}{_labels(labels or {})} {_number(value)}")

    def gauge(self, name: str, value: float, help_text: str) -> None:
        self.sample(self.family(name, "gauge", help_text), value)

    def counter(self, name: str, value: float, help_text: str) -> None:
        self.sample(self.family(name, "counter", help_text) + "_total", value)

    def histogram(self, name: str, help_text: str, bounds: tuple[float, ...], counts: list[int],
                  total: float) -> None:
        full = self.family(name, "histogram", help_text)
        cumulative = 0
        for bound, count in zip((*bounds, float("inf")), counts):
            cumulative += count
            self.sample(full + "_bucket", cumulative, {"le": _number(float(bound))})
        self.sample(full + "_sum", float(total))
        self.sample(full + "_count", cumulative)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render_metrics(stats: EngineStats, tracker: RequestTracker, num_waiting: int) -> str:
    w = _Writer()
    w.gauge("requests_running", stats.num_running, "Requests the engine is running (prefill or decode).")
    w.gauge("requests_waiting", stats.num_waiting, "Requests waiting in the engine's queue.")
    w.gauge("server_requests_active", len(tracker.live), "Generations the HTTP server has in flight.")
    w.gauge("server_queue_depth", num_waiting, "Generations with no token yet that the engine has not started.")
    w.counter("prompt_tokens", stats.total_prompt_tokens, "Prompt tokens of finished requests.")
    w.counter("generation_tokens", stats.total_generated_tokens, "Generated tokens.")
    w.counter("engine_requests_finished", stats.total_requests, "Requests the engine finished, any reason.")
    w.counter("preemptions", stats.num_preemptions, "Sequences preempted for lack of KV pages.")
    w.gauge("kv_pages_total", stats.pages_total, "KV cache pages in the pool.")
    w.gauge("kv_pages_used", stats.pages_used, "KV pages referenced by live sequences.")
    w.gauge("kv_pages_cached", stats.pages_cached, "KV pages held only by the prefix cache.")
    w.gauge("kv_pages_free", stats.pages_free, "KV pages free.")
    w.gauge("kv_page_size_tokens", stats.page_size, "Tokens per KV page.")
    w.counter("prefix_cache_queries", stats.prefix_cache_queries, "Prompt tokens looked up in the prefix cache.")
    w.counter("prefix_cache_hits", stats.prefix_cache_hits, "Prompt tokens served from the prefix cache.")
    w.gauge("batch_size", stats.last_batch_size, "Sequences in the last engine step.")
    w.gauge("step_tokens", stats.last_step_tokens, "Tokens in the last engine step.")
    w.gauge("generation_tokens_per_second", stats.tokens_per_s, "Generated tokens per second, recent window.")
    counts = list(stats.step_time_bucket_counts) or [0] * (len(STEP_TIME_BUCKETS) + 1)
    w.histogram("step_time_seconds", "Wall time of one engine step.", STEP_TIME_BUCKETS, counts,
                stats.step_time_sum_s)
    _tracker_histogram(w, "time_to_first_token_seconds", "Seconds from arrival to the first token.",
                       tracker.ttft)
    _tracker_histogram(w, "request_latency_seconds", "Seconds from arrival to the last token.",
                       tracker.latency)
    name = w.family("server_generations_finished", "counter", "Generations the server finished, by reason.")
    for reason, count in sorted(tracker.finished_by_reason.items()):
        w.sample(name + "_total", count, {"reason": reason})
    name = w.family("server_requests_rejected", "counter", "Requests refused before they ran, by reason.")
    for reason, count in sorted(tracker.rejected_by_reason.items()):
        w.sample(name + "_total", count, {"reason": reason})
    name = w.family("http_responses", "counter", "HTTP responses by endpoint and status.")
    for (endpoint, status), count in sorted(tracker.responses_by_status.items()):
        w.sample(name + "_total", count, {"endpoint": endpoint, "status": str(status)})
    return w.text()


def _tracker_histogram(w: _Writer, name: str, help_text: str, h: Histogram) -> None:
    w.histogram(name, help_text, h.bounds, h.counts, h.total)


class ResponseCounter:
    """ASGI middleware counting responses by endpoint and status, for /metrics."""

    def __init__(self, app: ASGIApp, tracker: RequestTracker) -> None:
        self.app = app
        self.tracker = tracker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in KNOWN_ENDPOINTS else ("/cancel" if path.startswith("/cancel/") else "other")

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.tracker.count_response(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
