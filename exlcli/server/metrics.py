"""/metrics through prometheus_client, in the app's own CollectorRegistry (the tracker's; no
global registry).

vLLM's names where a dashboard looks for them (vllm:num_requests_running, vllm:kv_cache_usage_perc,
vllm:prompt_tokens_total, vllm:time_to_first_token_seconds, ...; label model_name), exlcli_ names
for what only exlcli has (KV pages, step time, the HTTP server's own counts). Request histograms are
observed by the tracker as requests finish; everything the engine counts is read from its
EngineStats at scrape time by `EngineCollector`. Rates come from `EngineRates`, so they fall to 0
when the engine is idle.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exlcli.engine.stats import STEP_TIME_BUCKETS
from exlcli.server.tracker import RequestTracker

# Paths counted by name in exlcli_http_responses_total; any other path counts as "other".
KNOWN_ENDPOINTS = {"/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
                   "/health", "/metrics", "/tokenize", "/stats", "/v1/messages", "/v1/messages/count_tokens"}


def render_metrics(tracker: RequestTracker, accept: str | None = None) -> tuple[bytes, str]:
    """-> (body, content type): the text format 0.0.4, or OpenMetrics if the scraper asks for it."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(tracker.registry), content_type


class EngineCollector(Collector):
    """What the engine and the HTTP server count, read when scraped (on the event loop thread)."""

    def __init__(self, state) -> None:
        self.state = state  # the app's ServerState (app.py imports this module, not the other way)

    def collect(self) -> Iterator[Metric]:
        state, tracker = self.state, self.state.tracker
        name, stats = state.engine_view()
        num_waiting = tracker.num_waiting(stats) + state.num_starting
        rates = state.rates.observe(stats, tracker.clock())
        model = {"model_name": name}

        def vllm_gauge(name: str, help_text: str, value: float) -> Metric:
            g = GaugeMetricFamily("vllm:" + name, help_text, labels=list(model))
            g.add_metric(list(model.values()), value)
            return g

        def vllm_counter(name: str, help_text: str, value: float) -> Metric:
            c = CounterMetricFamily("vllm:" + name, help_text, labels=list(model))
            c.add_metric(list(model.values()), value)
            return c

        def gauge(name: str, help_text: str, value: float) -> Metric:
            return GaugeMetricFamily("exlcli_" + name, help_text, value=value)

        def counter(name: str, help_text: str, value: float) -> Metric:
            return CounterMetricFamily("exlcli_" + name, help_text, value=value)

        def by_label(name: str, help_text: str, labels: list[str], counts: dict) -> Metric:
            c = CounterMetricFamily("exlcli_" + name, help_text, labels=labels)
            for key, count in sorted(counts.items()):
                c.add_metric([str(k) for k in (key if isinstance(key, tuple) else (key,))], count)
            return c

        kv_usage = stats.pages_used / stats.pages_total if stats.pages_total else 0.0
        yield vllm_gauge("num_requests_running", "Requests the engine is running (prefill or decode).",
                         stats.num_running)
        yield vllm_gauge("num_requests_waiting", "Requests waiting in the engine's queue.", stats.num_waiting)
        yield vllm_gauge("kv_cache_usage_perc", "Fraction of KV pages referenced by live sequences (1 = all).",
                         kv_usage)
        yield vllm_gauge("gpu_cache_usage_perc", "Same as vllm:kv_cache_usage_perc (vLLM's older name).", kv_usage)
        yield vllm_counter("prompt_tokens", "Prompt tokens of finished requests.", stats.total_prompt_tokens)
        yield vllm_counter("generation_tokens", "Generated tokens of finished requests.",
                           stats.total_generated_tokens)
        yield vllm_counter("num_preemptions", "Sequences preempted for lack of KV pages.", stats.num_preemptions)
        yield vllm_counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                           stats.prefix_cache_queries)
        yield vllm_counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                           stats.prefix_cache_hits)
        yield from spec_decode_metrics(stats, model)
        success = CounterMetricFamily("vllm:request_success", "Requests that finished with stop or length.",
                                      labels=["model_name", "finished_reason"])
        for reason in ("stop", "length"):
            success.add_metric([model["model_name"], reason], tracker.finished_by_reason.get(reason, 0))
        yield success

        yield gauge("server_requests_active", "Generations the HTTP server has in flight.", len(tracker.live))
        yield gauge("server_queue_depth", "Generations with no token yet that the engine has not started.",
                    num_waiting)
        yield counter("engine_requests_finished", "Requests the engine finished, any reason.", stats.total_requests)
        yield counter("engine_step_failures", "Engine steps (or parts of steps) that raised; the loop went on.",
                      stats.step_failures)
        yield counter("engine_requests_failed", "Requests the engine ended with an error.", stats.requests_failed)
        yield counter("engine_nonfinite_logits", "Requests ended because their logits were NaN or infinite.",
                      stats.nonfinite_logits)
        yield counter("prefix_cache_evictions", "KV pages evicted from the prefix cache.",
                      stats.prefix_cache_evictions)
        yield gauge("kv_pages_total", "KV cache pages in the pool.", stats.pages_total)
        yield gauge("kv_pages_used", "KV pages referenced by live sequences.", stats.pages_used)
        yield gauge("kv_pages_cached", "KV pages held only by the prefix cache.", stats.pages_cached)
        yield gauge("kv_pages_free", "KV pages free.", stats.pages_free)
        if len(stats.pages_used_by_group) > 1:  # a cache in layer groups (one page holds one group's layers)
            by_group = GaugeMetricFamily("exlcli_kv_pages_used_by_group", "KV pages referenced by live sequences, "
                                         "per layer group of the cache (window: its tokens, or full).",
                                         labels=["group", "window"])
            for g, (used, window) in enumerate(zip(stats.pages_used_by_group, stats.page_group_windows)):
                by_group.add_metric([str(g), window], used)
            yield by_group
        yield gauge("kv_page_size_tokens", "Tokens per KV page.", stats.page_size)
        if stats.kv_cache_type_k:  # an engine's (a fake client has no cache)
            cache_types = GaugeMetricFamily("exlcli_kv_cache_info", "The KV cache's types of K and V (value 1).",
                                            labels=["type_k", "type_v"])
            cache_types.add_metric([stats.kv_cache_type_k, stats.kv_cache_type_v], 1)
            yield cache_types
        yield gauge("batch_size", "Sequences in the last engine step; 0 when the engine has not stepped lately.",
                    rates.batch_size)
        yield gauge("step_tokens", "Tokens in the last engine step; 0 when the engine has not stepped lately.",
                    rates.step_tokens)
        yield gauge("generation_tokens_per_second", "Generated tokens per second over the last few seconds.",
                    rates.generation_tokens_per_s)
        yield gauge("prompt_tokens_per_second", "Prompt tokens (of finished requests) per second, last few seconds.",
                    rates.prompt_tokens_per_s)
        counts = list(stats.step_time_bucket_counts) or [0] * (len(STEP_TIME_BUCKETS) + 1)
        cumulative, buckets = 0, []
        for bound, count in zip((*STEP_TIME_BUCKETS, float("inf")), counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        yield HistogramMetricFamily("exlcli_step_time_seconds", "Wall time of one engine step.", buckets=buckets,
                                    sum_value=stats.step_time_sum_s)
        yield by_label("server_generations_finished", "Generations the server finished, by reason.", ["reason"],
                       tracker.finished_by_reason)
        yield by_label("server_requests_rejected", "Requests refused before they ran, by reason.", ["reason"],
                       tracker.rejected_by_reason)
        yield by_label("http_responses", "HTTP responses by endpoint and status.", ["endpoint", "status"],
                       tracker.responses_by_status)


def spec_decode_metrics(stats, model: dict) -> Iterator[Metric]:
    """vLLM v1's speculative-decoding counters (always present: zero without speculation)."""
    labels, values = list(model), list(model.values())

    def vllm_counter(name: str, help_text: str, value: float) -> Metric:
        c = CounterMetricFamily("vllm:" + name, help_text, labels=labels)
        c.add_metric(values, value)
        return c

    yield vllm_counter("spec_decode_num_drafts", "Verify steps of sequences with drafted tokens.",
                       stats.spec_verify_steps)
    yield vllm_counter("spec_decode_num_draft_tokens", "Drafted tokens verified.", stats.spec_drafted_tokens)
    yield vllm_counter("spec_decode_num_accepted_tokens", "Drafted tokens accepted.", stats.spec_accepted_tokens)
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Drafted tokens accepted, by position in the draft (0: the first).",
                                  labels=labels + ["position"])
    for position, count in enumerate(stats.spec_accepted_by_position):
        per_pos.add_metric(values + [str(position)], count)
    yield per_pos
    drafted = CounterMetricFamily("exlcli_spec_decode_num_draft_tokens_per_pos",
                                  "Drafted tokens verified, by position in the draft (0: the first).",
                                  labels=["position"])
    for position, count in enumerate(stats.spec_drafted_by_position):
        drafted.add_metric([str(position)], count)
    yield drafted


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
