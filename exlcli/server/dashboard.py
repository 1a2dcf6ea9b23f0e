"""What the operator sees on the server's terminal: a Rich live display on a TTY (one row per
active request, engine lines, recently finished requests), plain log lines otherwise.

Both read a `DashboardSnapshot` built on the event loop, so rendering is a pure function that
tests can check without a server. The display fits the terminal's width: header lines break
between fields, tables drop their least useful columns and shorten ids in the middle (the tail of
`chatcmpl-...` is what tells two requests apart), and no row ever wraps.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.table import Table
from rich.text import Text

from exlcli.engine.stats import EngineStats
from exlcli.server.rates import RatesView
from exlcli.server.tracker import FinishedGeneration, Generation, RequestTracker

REFRESH_S = 0.25
PLAIN_ENGINE_LINE_EVERY_S = 10.0
SPARK = "▁▂▃▄▅▆▇█"
MIN_ID_WIDTH = 22  # "chatcmpl-…" and 12 characters of the tail


@dataclass
class Latencies:
    """Over the last minute; None where nothing was measured."""

    ttft_p50: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None


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
    rates: RatesView = field(default_factory=RatesView)
    history: list[float] = field(default_factory=list)  # generated tok/s, oldest first
    latencies: Latencies = field(default_factory=Latencies)
    models: list[str] = field(default_factory=list)  # one line per served model, when there are several


def take_snapshot(state, url: str, max_rows: int = 20) -> DashboardSnapshot:
    """`state` is the app's ServerState; call on the event loop thread."""
    model, stats = state.engine_view()
    tracker: RequestTracker = state.tracker
    now = tracker.clock()
    waiting = tracker.num_waiting(stats) + state.num_starting
    rates = state.rates.observe(stats, now)
    latencies = Latencies(tracker.recent_ttft.percentile(50, now), tracker.recent_ttft.percentile(99, now),
                          tracker.recent_itl.percentile(50, now), tracker.recent_itl.percentile(99, now))
    return DashboardSnapshot(
        url=url, model=model, stats=stats, rows=tracker.rows(), recent=list(tracker.recent),
        models=model_lines(state.pool) if len(state.pool.models) > 1 else [],
        num_waiting=waiting, num_served=sum(tracker.finished_by_reason.values()),
        num_rejected=sum(tracker.rejected_by_reason.values()), draining=state.draining, now=now,
        max_rows=max_rows, rates=rates, history=list(state.rates.history), latencies=latencies)


def model_lines(pool) -> list[str]:
    """Each served model: its state, memory and how long it stays loaded idle (pool: a ModelPool)."""
    lines = []
    for m in pool.models:
        info = pool.describe(m, time.time())
        parts = [m.name + (" (default)" if info["default"] else ""), info["status"]]
        if info["memory_bytes"]:
            parts.append(f"{info['memory_bytes'] / 1e6:.0f} MB")
        if info["running"]:
            parts.append(f"{info['running']} running")
        left = pool.expires_in(m)
        if m.client is not None:
            parts.append("kept forever" if left is None else f"unloads in {_age(left)} idle")
        if info.get("error"):
            parts.append(info["error"])
        lines.append("  ".join(parts))
    return lines


# ---- formatting ----

def _age(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 60 else f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def sparkline(values: list[float], width: int) -> str:
    values = values[-width:]
    if not values:
        return ""
    top = max(values)
    if top <= 0:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] for v in values)


def short_id(rid: str, width: int) -> str:
    """Fit an id into `width` by cutting its middle: `chatcmpl-…9f3a1c`."""
    if len(rid) <= width:
        return rid
    head = rid[:rid.index("-") + 1] if "-" in rid else ""
    if width - len(head) - 1 < 6:
        head = ""
    return head + "…" + rid[len(rid) - (width - len(head) - 1):]


def _priority(p: str) -> str:
    return "int" if p == "interactive" else p


def server_parts(snap: DashboardSnapshot) -> list[str]:
    state = "DRAINING: finishing running requests, then exiting" if snap.draining else "serving"
    return ["exlcli serve", snap.url, f"model {snap.model}", state, f"active {len(snap.rows)}",
            f"finished {snap.num_served}", f"rejected {snap.num_rejected}"]


def engine_parts(snap: DashboardSnapshot) -> list[str]:
    s, r = snap.stats, snap.rates
    step = "step -" if r.step_time_s is None else f"step {r.step_time_s * 1000:.1f} ms"
    return ["engine", f"{r.generation_tokens_per_s:.1f} tok/s", f"batch {r.batch_size}", step,
            f"running {s.num_running}", f"queue {snap.num_waiting}"]


def cache_parts(snap: DashboardSnapshot) -> list[str]:
    s = snap.stats
    kv = f"{100 * s.pages_used / s.pages_total:.0f}% used" if s.pages_total else "-"
    k_type, v_type = s.kv_cache_type_k, s.kv_cache_type_v
    types = "" if not k_type else f"{k_type}, " if k_type == v_type else f"K {k_type} V {v_type}, "
    pages = types + f"pages {s.pages_used}/{s.pages_total}, {s.pages_free} free" + (
        f", {s.pages_cached} cached" if s.pages_cached else "")
    hit = f"prefix hit {100 * s.prefix_cache_hit_rate:.0f}%" if s.prefix_cache_queries else "prefix hit -"
    return ["KV", kv, pages, hit, f"preemptions {s.num_preemptions}"]


def spec_parts(snap: DashboardSnapshot) -> list[str]:
    """Speculative decoding's counters; none when the engine does not speculate."""
    s = snap.stats
    if not s.spec_method:
        return []
    if not s.spec_drafted_tokens:
        return [f"spec {s.spec_method}", "drafted 0"]
    by_pos = " ".join(f"{100 * r:.0f}" for r in s.spec_acceptance_by_position)
    return [f"spec {s.spec_method}", f"drafted {s.spec_drafted_tokens}",
            f"accepted {s.spec_accepted_tokens} ({100 * s.spec_acceptance_rate:.0f}%)", f"by position {by_pos} %"]


def window_parts(snap: DashboardSnapshot) -> list[str]:
    """Past the context window (engine/context_window.py) and continuations (engine/sessions.py); none
    while the engine stops at the window and no request or session has used either."""
    s = snap.stats
    if s.context_overflow == "stop" and not (s.evicted_tokens or s.sessions_parked or s.sessions_resumed):
        return []
    method = s.context_overflow + (f" {s.window} tokens, {s.sink_tokens} sinks" if s.context_overflow != "stop" else "")
    shifted = sum(1 for a in s.active if a.evicted_tokens)
    return ["window", method, f"evicted {s.evicted_tokens} tokens", f"past it now {shifted}",
            f"sessions {s.sessions_parked} ({s.session_pages} pages)",
            f"resumed {s.sessions_resumed} ({s.session_resumed_tokens} tokens not recomputed)"]


def latency_parts(snap: DashboardSnapshot) -> list[str]:
    lat = snap.latencies
    return ["latency, last 1m", f"TTFT p50 {_secs(lat.ttft_p50)} p99 {_secs(lat.ttft_p99)}",
            f"ITL p50 {_secs(lat.itl_p50)} p99 {_secs(lat.itl_p99)}"]


def engine_line(snap: DashboardSnapshot) -> str:
    return "  ".join(engine_parts(snap) + cache_parts(snap) + spec_parts(snap) + window_parts(snap)
                     + latency_parts(snap))


def server_line(snap: DashboardSnapshot) -> str:
    return "  ".join(server_parts(snap))


def pack(parts: list[str], width: int, indent: int = 2) -> list[str]:
    """Join parts with two spaces into lines of at most `width`, breaking only between parts."""
    lines: list[str] = []
    line = ""
    for part in parts:
        if line and len(line) + 2 + len(part) > width:
            lines.append(line)
            line = " " * indent + part
        else:
            line = f"{line}  {part}" if line else part
    if line:
        lines.append(line)
    return lines


# ---- tables that fit ----

@dataclass
class Column:
    name: str
    cells: list[str]
    justify: str = "right"
    required: bool = False

    @property
    def width(self) -> int:
        return max([len(self.name), *map(len, self.cells)])


def fit_table(title: str, ids: list[str], columns: list[Column], width: int, empty: str,
              importance: list[str] | None = None) -> Table:
    """The id column, then `columns`: the required ones always, the others by `importance` (names;
    default: the order given) while they fit; the id gets what is left (down to MIN_ID_WIDTH),
    shortened in the middle."""
    id_natural = max([2, *map(len, ids)]) if ids else max(2, len(empty))  # an empty table shows `empty` whole
    chosen = [c for c in columns if c.required]
    used = sum(c.width + 1 for c in chosen) + min(id_natural, MIN_ID_WIDTH) + 1
    ranked = sorted(columns, key=lambda c: importance.index(c.name)) if importance else columns
    for c in ranked:
        if not c.required and used + c.width + 1 <= width:
            chosen.append(c)
            used += c.width + 1
    chosen.sort(key=columns.index)
    id_width = max(min(id_natural, MIN_ID_WIDTH), min(id_natural, width - sum(c.width + 1 for c in chosen) - 1))
    table = Table(title=title, title_justify="left", box=None, padding=(0, 1, 0, 0), expand=False,
                  show_edge=False)
    table.add_column("id", justify="left", no_wrap=True, width=id_width, overflow="crop")
    for c in chosen:
        table.add_column(c.name, justify=c.justify, no_wrap=True, width=c.width, overflow="crop")  # type: ignore[arg-type]
    for i, rid in enumerate(ids):
        table.add_row(short_id(rid, id_width), *(c.cells[i] for c in chosen))
    if not ids:
        table.add_row(empty, *("" for _ in chosen))
    return table


def active_table(snap: DashboardSnapshot, width: int) -> Table:
    rows = snap.rows[:snap.max_rows]
    ids = [g.display_id for g in rows]
    columns = [  # in the order shown
        Column("client", [g.client for g in rows], "left"),
        Column("pri", [_priority(g.priority) for g in rows], "left"),
        Column("state", [g.state for g in rows], "left", required=True),
        Column("prompt", ["-" if g.prompt_tokens is None else str(g.prompt_tokens) for g in rows]),
        Column("gen", [str(g.generated_tokens) for g in rows], required=True),
        Column("tok/s", [f"{g.tokens_per_s(snap.now):.1f}" for g in rows], required=True),
        Column("ttft", [_secs(g.ttft_s) for g in rows]),
        Column("age", [_age(snap.now - g.started) for g in rows]),
    ]
    return fit_table("active requests", ids, columns, width, "(none)",
                     importance=["state", "gen", "tok/s", "pri", "client", "ttft", "prompt", "age"])


def recent_table(snap: DashboardSnapshot, width: int) -> Table:
    ids = [f.display_id or f.gen_id for f in snap.recent]
    columns = [
        Column("reason", [f.finish_reason for f in snap.recent], "left", required=True),
        Column("gen", [str(f.generated_tokens) for f in snap.recent], required=True),
        Column("ttft", [_secs(f.ttft_s) for f in snap.recent]),
        Column("total", [_age(f.total_s) for f in snap.recent]),
        Column("pri", [_priority(f.priority) for f in snap.recent], "left"),
        Column("prompt", [str(f.prompt_tokens) for f in snap.recent]),
        Column("client", [f.client for f in snap.recent], "left"),
    ]
    return fit_table("recently finished", ids, columns, width, "(none)")


class Dashboard:
    """The live display's content for one snapshot; lays itself out for the console's width."""

    def __init__(self, snap: DashboardSnapshot) -> None:
        self.snap = snap

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        snap, width = self.snap, options.max_width
        for line in pack(server_parts(snap), width):
            yield Text(line, style="bold red" if snap.draining else "bold", no_wrap=True, overflow="ellipsis")
        engine = engine_parts(snap)
        spark = sparkline(snap.history, max(10, min(60, width - 60)))
        if spark:
            engine.insert(2, spark)
        for group in (engine, cache_parts(snap), spec_parts(snap), window_parts(snap), latency_parts(snap)):
            for line in pack(group, width) if group else []:
                yield Text(line, style="cyan", no_wrap=True, overflow="ellipsis")
        for line in snap.models:
            yield Text("model " + line, style="magenta", no_wrap=True, overflow="ellipsis")
        yield Text("")
        yield active_table(snap, width)
        if len(snap.rows) > snap.max_rows:
            yield Text(f"... {len(snap.rows) - snap.max_rows} more", no_wrap=True)
        yield Text("")
        yield recent_table(snap, width)


def render(snap: DashboardSnapshot) -> Dashboard:
    return Dashboard(snap)


def finished_line(f: FinishedGeneration) -> str:
    ttft = "-" if f.ttft_s is None else f"{f.ttft_s:.3f}s"
    return (f"{time.strftime('%H:%M:%S', time.localtime(f.finished_at))} finished {f.display_id or f.gen_id} "
            f"client={f.client} priority={f.priority or '-'} reason={f.finish_reason} prompt={f.prompt_tokens} "
            f"gen={f.generated_tokens} ttft={ttft} total={f.total_s:.3f}s")


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
                    rows = max(3, self.console.size.height - 18)
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
