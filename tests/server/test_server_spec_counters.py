"""Speculative decoding's counters where an operator looks: /metrics under vLLM's spec-decode
names (per position too), the serve display's line, and the engine's one-line summary."""

from __future__ import annotations

import io

from rich.console import Console
from server_helpers import metric, parse_prometheus
from starlette.testclient import TestClient

from exlcli.client.fake import FakeClient
from exlcli.engine.stats import EngineStats
from exlcli.server.app import ServerConfig, ServerState, create_app
from exlcli.server.dashboard import engine_line, render, take_snapshot
from exlcli.server.tracker import RequestTracker

SPECULATING = dict(spec_method="ngram", spec_verify_steps=10, spec_drafted_tokens=30, spec_accepted_tokens=18,
                   spec_drafted_by_position=[10, 10, 10, 0], spec_accepted_by_position=[9, 6, 3, 0])


class SpecStatsClient(FakeClient):
    def __init__(self, **stats) -> None:
        super().__init__()
        self.view = EngineStats(pages_total=8, **stats)

    def stats(self) -> EngineStats:
        return self.view


def scrape(client) -> tuple[dict, list]:
    with TestClient(create_app(client)) as http:
        return parse_prometheus(http.get("/metrics").text)


def test_metrics_use_vllm_spec_decode_names():
    types, samples = scrape(SpecStatsClient(**SPECULATING))
    model = {"model_name": "fake-echo"}
    assert types["vllm:spec_decode_num_drafts"] == "counter"
    assert metric(samples, "vllm:spec_decode_num_drafts_total", **model) == 10
    assert metric(samples, "vllm:spec_decode_num_draft_tokens_total", **model) == 30
    assert metric(samples, "vllm:spec_decode_num_accepted_tokens_total", **model) == 18
    per_pos = [metric(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i), **model)
               for i in range(4)]
    assert per_pos == [9, 6, 3, 0]
    assert metric(samples, "exlcli_spec_decode_num_draft_tokens_per_pos_total", position="1") == 10


def test_metrics_without_speculation_are_zero():
    _, samples = scrape(SpecStatsClient())
    assert metric(samples, "vllm:spec_decode_num_draft_tokens_total", model_name="fake-echo") == 0
    assert not [s for s in samples if s[0] == "vllm:spec_decode_num_accepted_tokens_per_pos_total"]


def screen(client) -> str:
    state = ServerState(client, ServerConfig(), RequestTracker())
    console = Console(record=True, width=130, color_system=None, force_terminal=False, file=io.StringIO())
    snap = take_snapshot(state, "http://127.0.0.1:8000")
    console.print(render(snap))
    return console.export_text() + "\n" + engine_line(snap)


def test_display_shows_drafted_accepted_and_the_rate_by_position():
    text = screen(SpecStatsClient(**SPECULATING))
    line = "spec ngram  drafted 30  accepted 18 (60%)  by position 90 60 30 %"
    assert line in text.splitlines() and line in text.splitlines()[-1]  # the live display and the log line
    assert "spec " not in screen(SpecStatsClient())  # an engine that does not speculate shows nothing
    assert "spec self  drafted 0" in screen(SpecStatsClient(spec_method="self"))


def test_engine_summary_line():
    s = EngineStats(**SPECULATING)
    assert s.spec_summary() == ("speculative ngram: drafted 30, accepted 18 (60%), by position 90 60 30 %, "
                                "2.80 tokens per verify step")
    assert EngineStats().spec_summary() == "speculative off"
    assert EngineStats(spec_method="self").spec_summary() == "speculative self: nothing drafted"
