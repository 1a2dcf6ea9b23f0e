"""The live display's content, rendered without a server; and the plain lines off a terminal."""

import asyncio
import io
import time

from rich.console import Console

from exlcli.client.base import TextDelta, Usage
from exlcli.client.fake import FakeClient
from exlcli.engine.stats import ActiveRequestInfo, EngineStats
from exlcli.server.app import ServerConfig, ServerState
from exlcli.server.dashboard import LogDashboard, render, take_snapshot
from exlcli.server.tracker import RequestTracker


class StatsClient(FakeClient):
    """Reports an engine view of two of the three requests, as the real engine would."""

    def stats(self) -> EngineStats:
        return EngineStats(num_running=2, num_waiting=1, pages_total=64, pages_used=12, pages_cached=3,
                           last_batch_size=2, last_step_time_s=0.0123, tokens_per_s=45.6, active=[
                               ActiveRequestInfo("g1", "chat", "decode", 31, 9, 20.0, 1.0),
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


def screen(state: ServerState, draining: bool = False) -> str:
    state.draining = draining
    console = Console(record=True, width=130, color_system=None, force_terminal=False)
    console.print(render(take_snapshot(state, "http://127.0.0.1:8000")))
    return console.export_text()


def test_rows_engine_line_and_recent():
    text = screen(make_state())
    lines = text.splitlines()
    assert "exlcli serve  http://127.0.0.1:8000  model fake-echo  serving  active 3  finished 1" in lines[0]
    assert ("engine  batch 2  step 12.3 ms  45.6 tok/s  pages 12/64 used, 49 free, 3 cached  running 2  "
            "queue 1") in lines[1]
    rows = {line.split()[0]: line.split() for line in lines if line.strip().startswith("g")}
    assert rows["g1"][:5] == ["g1", "chat", "decode", "31", "0"]  # engine view: state, prompt size
    assert rows["g2"][:5] == ["g2", "chat", "decode", "-", "1"]  # no engine view; has a token
    assert rows["g3"][:4] == ["g3", "batch", "waiting", "17"]
    assert rows["g0"] == ["g0", "bench", "length", "7", "16", "0.25s", "1.5s"]  # recently finished


def test_draining_is_shown():
    assert "DRAINING: finishing running requests, then exiting" in screen(make_state(), draining=True)


def test_row_count_is_capped():
    state = make_state()
    for i in range(30):
        state.tracker.start(f"x{i}", "api", "interactive", "chat")
    console = Console(record=True, width=130, color_system=None, force_terminal=False)
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
    assert "finished req-7 client=chat reason=stop prompt=12 gen=1 ttft=0.500s total=" in line
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
    assert "engine  batch 2" in out.getvalue() and "active 3" in out.getvalue()
