"""What the operator sees on the server's terminal: a Rich live display on a TTY (one row per
active request, an engine line, recently finished requests), plain log lines otherwise.

Both read a `DashboardSnapshot` built on the event loop, so rendering is a pure function that
tests can check without a server.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from exlcli.engine.stats import EngineStats
from exlcli.server.tracker import FinishedGeneration, Generation, RequestTracker

REFRESH_S = 0.25
PLAIN_ENGINE_LINE_EVERY_S = 10.0


@dataclass
class DashboardSnapshot:
    url: str
    model: str
    stats: EngineStats
    rows: list[Generation]
    recent: list[FinishedGeneration]
    num_waiting: int
    num_served: int
    num_rejected: int
    draining: bool = False
    now: float = field(default_factory=time.monotonic)
    max_rows: int = 20


def take_snapshot(state, url: str, max_rows: int = 20) -> DashboardSnapshot:
    """`state` is the app's ServerState; call on the event loop thread."""
    stats = state.client.stats()
    tracker: RequestTracker = state.tracker
    waiting = tracker.num_waiting(stats) + state.num_starting
    return DashboardSnapshot(
        url=url, model=state.client.model_name, stats=stats, rows=tracker.rows(), recent=list(tracker.recent),
        num_waiting=waiting, num_served=sum(tracker.finished_by_reason.values()),
        num_rejected=sum(tracker.rejected_by_reason.values()), draining=state.draining, max_rows=max_rows)


def _age(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 60 else f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def engine_line(snap: DashboardSnapshot) -> str:
    s = snap.stats
    pages = f"pages {s.pages_used}/{s.pages_total} used, {s.pages_free} free"
    if s.pages_cached:
        pages += f", {s.pages_cached} cached"
    return (f"engine  batch {s.last_batch_size}  step {s.last_step_time_s * 1000:.1f} ms  "
            f"{s.tokens_per_s:.1f} tok/s  {pages}  running {s.num_running}  queue {snap.num_waiting}")


def server_line(snap: DashboardSnapshot) -> str:
    state = "DRAINING: finishing running requests, then exiting" if snap.draining else "serving"
    return (f"exlcli serve  {snap.url}  model {snap.model}  {state}  "
            f"active {len(snap.rows)}  finished {snap.num_served}  rejected {snap.num_rejected}")


def render(snap: DashboardSnapshot) -> RenderableType:
    header = Text(server_line(snap), style="bold red" if snap.draining else "bold")
    active = Table(title="active requests", title_justify="left", expand=False, box=None, padding=(0, 1))
    for name, justify in (("id", "left"), ("client", "left"), ("state", "left"), ("prompt", "right"),
                          ("gen", "right"), ("tok/s", "right"), ("age", "right")):
        active.add_column(name, justify=justify)  # type: ignore[arg-type]
    for g in snap.rows[:snap.max_rows]:
        active.add_row(g.gen_id[-12:], g.client, g.state,
                       "-" if g.prompt_tokens is None else str(g.prompt_tokens), str(g.generated_tokens),
                       f"{g.tokens_per_s(snap.now):.1f}", _age(snap.now - g.started))
    if len(snap.rows) > snap.max_rows:
        active.add_row(f"... {len(snap.rows) - snap.max_rows} more", "", "", "", "", "", "")
    if not snap.rows:
        active.add_row("(none)", "", "", "", "", "", "")
    recent = Table(title="recently finished", title_justify="left", box=None, padding=(0, 1))
    for name, justify in (("id", "left"), ("client", "left"), ("reason", "left"), ("prompt", "right"),
                          ("gen", "right"), ("ttft", "right"), ("total", "right")):
        recent.add_column(name, justify=justify)  # type: ignore[arg-type]
    for f in snap.recent:
        recent.add_row(f.gen_id[-12:], f.client, f.finish_reason, str(f.prompt_tokens), str(f.generated_tokens),
                       "-" if f.ttft_s is None else f"{f.ttft_s:.2f}s", _age(f.total_s))
    return Group(header, Text(engine_line(snap), style="cyan"), Text(""), active, Text(""), recent)


def finished_line(f: FinishedGeneration) -> str:
    ttft = "-" if f.ttft_s is None else f"{f.ttft_s:.3f}s"
    return (f"{time.strftime('%H:%M:%S', time.localtime(f.finished_at))} finished {f.gen_id} "
            f"client={f.client} reason={f.finish_reason} prompt={f.prompt_tokens} gen={f.generated_tokens} "
            f"ttft={ttft} total={f.total_s:.3f}s")


class LiveDashboard:
    """The Rich live display, refreshed from the event loop."""

    def __init__(self, url: str, console: Console | None = None) -> None:
        self.url = url
        self.console = console or Console(stderr=True)
        self._live: Live | None = None

    def note(self, message: str) -> None:
        self.console.print(message)

    def on_finish(self, f: FinishedGeneration) -> None:
        pass  # the display shows it

    async def run(self, state) -> None:
        self._live = Live(console=self.console, auto_refresh=False, transient=False, redirect_stderr=False,
                          redirect_stdout=False)
        with self._live:
            try:
                while True:
                    rows = max(3, self.console.size.height - 16)
                    self._live.update(render(take_snapshot(state, self.url, rows)), refresh=True)
                    await asyncio.sleep(REFRESH_S)
            finally:
                self._live.update(render(take_snapshot(state, self.url)), refresh=True)


class LogDashboard:
    """Plain lines for a log file or pipe: one per finished request, an engine line now and then."""

    def __init__(self, url: str, stream: TextIO | None = None) -> None:
        self.url = url
        self.stream = stream or sys.stderr

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def note(self, message: str) -> None:
        self._print(message)

    def on_finish(self, f: FinishedGeneration) -> None:
        self._print(finished_line(f))

    async def run(self, state) -> None:
        last_line = ""
        while True:
            await asyncio.sleep(PLAIN_ENGINE_LINE_EVERY_S)
            snap = take_snapshot(state, self.url)
            line = engine_line(snap)
            if snap.rows or line != last_line:  # quiet when idle
                self._print(f"{time.strftime('%H:%M:%S')} {line}  active {len(snap.rows)}")
                last_line = line
