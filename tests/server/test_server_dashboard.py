"""The live display's content, rendered without a server; and the plain lines off a terminal."""

import asyncio
import dataclasses
import io
import json
import time

import httpx
import pytest
from rich.console import Console
from server_helpers import FakeClock, SchedulingFakeClient, running_server, wait_until

from exlcli.client.base import TextDelta, Usage
from exlcli.client.fake import FakeClient
from exlcli.engine.stats import ActiveRequestInfo, EngineStats
from exlcli.server.app import ServerConfig, ServerState
from exlcli.server.dashboard import LogDashboard, engine_line, render, sparkline, take_snapshot
from exlcli.server.tracker import RequestTracker


class StatsClient(FakeClient):
    """Reports an engine view of two of the three requests, as the real engine would."""

    def __init__(self) -> None:
        super().__init__()
        self.view = EngineStats(num_running=2, num_waiting=1, pages_total=64, pages_used=12, pages_cached=3,
                                last_batch_size=2, last_step_time_s=0.0123, tokens_per_s=45.6, num_preemptions=2,
                                prefix_cache_queries=40, prefix_cache_hits=30)

    def stats(self) -> EngineStats:
        return dataclasses.replace(self.view, active=[
            ActiveRequestInfo("g1", "chat", "decode", 31, 0, 20.0, 1.0),
            ActiveRequestInfo("g3", "batch", "waiting", 17, 0, 0.0, 0.5)])


def make_state() -> ServerState:
    tracker = RequestTracker()
    state = ServerState(StatsClient(), ServerConfig(), tracker)
    for gen_id, client in (("g1", "chat"), ("g2", "chat"), ("g3", "batch")):
        tracker.start(gen_id, client, "batch" if client == "batch" else "interactive", "chat")
    tracker.on_delta(tracker.live["g2"], TextDelta(text="hi", token_ids=[5]))
    done = tracker.start("g0", "bench", "batch", "completions")
    tracker.on_delta(done, TextDelta(finish_reason="length", usage=Usage(
        prompt_tokens=7, completion_tokens=16, ttft=0.25, total_time=1.5)))
    return state


def screen(state: ServerState, draining: bool = False, width: int = 130) -> str:
    state.draining = draining
    console = Console(record=True, width=width, color_system=None, force_terminal=False, file=io.StringIO())
    console.print(render(take_snapshot(state, "http://127.0.0.1:8000")))
    return console.export_text()


def table_rows(text: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in text.splitlines() if line.strip().startswith(("g", "chat"))}


def test_rows_engine_lines_and_recent():
    text = screen(make_state())
    lines = text.splitlines()
    assert "exlcli serve  http://127.0.0.1:8000  model fake-echo  serving  active 3  finished 1" in lines[0]
    assert lines[1].startswith("engine  0.0 tok/s  ") and "batch 2  step -  running 2  queue 1" in lines[1]
    assert "KV  19% used  pages 12/64, 49 free, 3 cached  prefix hit 75%  preemptions 2" in lines[2]
    assert "TTFT p50 250ms p99 250ms  ITL p50 - p99 -" in lines[3]
    rows = table_rows(text)
    assert rows["g1"][:7] == ["g1", "chat", "int", "decode", "31", "0", "0.0"]  # engine view: state, prompt size
    assert rows["g2"][:6] == ["g2", "chat", "int", "decode", "-", "1"]  # no engine view; has a token
    assert rows["g3"][:5] == ["g3", "batch", "batch", "waiting", "17"]
    assert rows["g0"] == ["g0", "length", "16", "250ms", "1.5s", "batch", "7", "bench"]  # recently finished


def test_fits_80_and_200_columns_without_wrapping_a_row():
    state = make_state()
    for i in range(2):
        gen = state.tracker.start(f"e{i}", "my-long-client-label", "interactive", "chat",
                                  response_id="chatcmpl-0123456789abcdef0123abcd", choice=i)
        state.tracker.on_delta(gen, TextDelta(text="x", token_ids=[1]))
    for width in (80, 200):
        text = screen(state, width=width)
        lines = text.splitlines()
        assert max(map(len, lines)) <= width
        rows = [line for line in lines if "chatcmpl-" in line]
        assert len(rows) == 2, text  # one line per request: nothing wrapped onto a second line
        for i, row in enumerate(rows):
            assert row.split()[0].endswith(f"0123abcd[{i}]")  # the tail that tells ids apart survives
            assert {"int", "decode", "1"} <= set(row.split())
        assert sum(line.startswith(("g1 ", "g2 ", "g3 ", "g0 ")) for line in lines) == 4
    assert "chatcmpl-0123456789abcdef0123abcd[0]" in screen(state, width=200)
    assert "chatcmpl-0123456789abcdef0123abcd[0]" not in screen(state, width=80)
    narrow = screen(state, width=50)
    assert max(map(len, narrow.splitlines())) <= 50
    assert len([line for line in narrow.splitlines() if "0123abcd[" in line]) == 2


def test_an_idle_server_shows_none_whole_in_both_tables():
    state = ServerState(FakeClient(), ServerConfig(), RequestTracker())
    for width in (80, 200):
        lines = screen(state, width=width).splitlines()
        assert max(map(len, lines)) <= width
        assert [line.strip() for line in lines if line.strip().startswith("(")] == ["(none)", "(none)"]


def test_percentiles_and_sparkline_over_the_last_minute():
    clock = FakeClock()
    tracker = RequestTracker(clock=clock)
    state = ServerState(StatsClient(), ServerConfig(), tracker)
    for i in range(100):  # TTFT 10 ms .. 1 s, each with a 20 ms gap between its two tokens
        gen = tracker.start(f"r{i}", "api", "interactive", "chat")
        clock.now += 0.01 * (i + 1)
        tracker.on_delta(gen, TextDelta(text="a", token_ids=[1]))
        clock.now += 0.02
        tracker.on_delta(gen, TextDelta(text="b", token_ids=[2], finish_reason="stop"))
    lat = take_snapshot(state, "u").latencies
    assert lat.ttft_p50 == pytest.approx(0.5) and lat.ttft_p99 == pytest.approx(0.99)
    assert lat.itl_p50 == pytest.approx(0.02) and lat.itl_p99 == pytest.approx(0.02)
    clock.now += 61
    assert take_snapshot(state, "u").latencies.ttft_p50 is None  # older than a minute
    assert sparkline([0, 5, 10], 10) == "▁▅█" and sparkline([0, 0], 10) == "▁▁" and sparkline([1] * 30, 5) == "█" * 5


def test_display_rates_fall_to_zero_when_idle():
    clock = FakeClock()
    client = StatsClient()
    state = ServerState(client, ServerConfig(), RequestTracker(clock=clock))
    client.view.total_generated_tokens = 0
    take_snapshot(state, "u")
    clock.now += 1
    client.view.total_generated_tokens = 50
    busy = take_snapshot(state, "u")
    assert busy.rates.generation_tokens_per_s == 50 and busy.rates.batch_size == 2
    client.view.num_running = 0
    for _ in range(4):
        clock.now += 2
        idle = take_snapshot(state, "u")
    assert idle.rates.generation_tokens_per_s == 0 and idle.rates.batch_size == 0
    assert "engine  0.0 tok/s" in engine_line(idle) and "batch 0" in engine_line(idle)
    assert idle.history[1] == 50 and idle.history[-1] == 0


def test_draining_is_shown():
    assert "DRAINING: finishing running requests, then exiting" in screen(make_state(), draining=True)


def test_row_count_is_capped():
    state = make_state()
    for i in range(30):
        state.tracker.start(f"x{i}", "api", "interactive", "chat")
    console = Console(record=True, width=130, color_system=None, force_terminal=False, file=io.StringIO())
    console.print(render(take_snapshot(state, "u", max_rows=5)))
    text = console.export_text()
    assert "... 28 more" in text
    assert "x29" not in text


def test_plain_log_lines_off_a_terminal():
    out = io.StringIO()
    display = LogDashboard("http://x", stream=out)
    tracker = RequestTracker(on_finish=display.on_finish)
    gen = tracker.start("req-7", "chat", "interactive", "chat")
    time.sleep(0.01)
    tracker.on_delta(gen, TextDelta(text="a", token_ids=[1]))
    tracker.on_delta(gen, TextDelta(finish_reason="stop", usage=Usage(prompt_tokens=12, completion_tokens=1, ttft=0.5)))
    line = out.getvalue().strip()
    assert "finished req-7 client=chat priority=interactive reason=stop prompt=12 gen=1 ttft=0.500s total=" in line
    assert "\x1b" not in line  # no colour codes in a log


def test_plain_engine_line_is_printed_while_busy(monkeypatch):
    import exlcli.server.dashboard as dashboard

    monkeypatch.setattr(dashboard, "PLAIN_ENGINE_LINE_EVERY_S", 0.01)
    out = io.StringIO()
    state = make_state()

    async def run_briefly():
        task = asyncio.create_task(LogDashboard("u", stream=out).run(state))
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(run_briefly())
    assert "engine  0.0 tok/s  batch 2" in out.getvalue() and "active 3" in out.getvalue()


def test_row_ids_are_the_ids_clients_see():
    client = SchedulingFakeClient(max_running=1, token_delay=0.001)
    client.running_allowed.clear()
    with running_server(client) as live:
        body = {"messages": [{"role": "user", "content": "x"}], "stream": True, "n": 2}
        with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=10) as response:
            # Keep the line iterator: a discarded one (`next(response.iter_lines())`) is finalised at once, and
            # httpcore then closes the unfinished response's connection; the server, seeing the client leave,
            # rightly cancels both choices (the rows then left `live` whenever its thread won the race).
            lines = response.iter_lines()
            first = json.loads(next(lines)[len("data: "):])
            assert wait_until(lambda: len(live.tracker.live) == 2)
            ids = sorted(g.display_id for g in live.tracker.rows())
            client.running_allowed.set()
            assert [line for line in lines if line][-1] == "data: [DONE]"  # served to the end
    assert first["id"].startswith("chatcmpl-") and response.headers["x-request-id"] == first["id"]
    assert ids == [f"{first['id']}[0]", f"{first['id']}[1]"]
    assert sorted((f.display_id, f.finish_reason) for f in live.tracker.recent) == [(i, "stop") for i in ids]


def test_the_window_line_shows_the_method_evictions_and_sessions():
    state = make_state()
    assert "window" not in screen(state).split()  # an engine that stops at its window: no line
    state.client.view = dataclasses.replace(state.client.view, context_overflow="sinks", window=512, sink_tokens=4,
                                            evicted_tokens=1536, sessions_parked=1, session_pages=32,
                                            sessions_resumed=9, session_resumed_tokens=4100)
    base_stats = state.client.stats

    def with_a_shifted_request():
        snap = base_stats()
        snap.active[0] = dataclasses.replace(snap.active[0], evicted_tokens=64, window=512)
        return snap

    state.client.stats = with_a_shifted_request
    text = screen(state, width=200)
    assert ("window  sinks 512 tokens, 4 sinks  evicted 1536 tokens  past it now 1  sessions 1 (32 pages)  "
            "resumed 9 (4100 tokens not recomputed)") in text
    assert "window  sinks 512 tokens" in engine_line(take_snapshot(state, "u"))
