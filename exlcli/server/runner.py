"""Run the app under uvicorn: bind first (so a busy port fails before the model loads), record the
address in the runtime file, show the display, and on SIGTERM or Ctrl-C drain, then exit."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
from types import FrameType

import uvicorn
from rich.console import Console

from exlcli.client.base import EngineClient
from exlcli.client.runtime_file import (
    ServerRecord,
    find_running_server,
    remove_record,
    secure_runtime_dir,
    write_record,
)
from exlcli.errors import ExlcliError
from exlcli.server.app import ServerConfig, ServerState, create_app
from exlcli.server.connections import ConnectionLimits, LimitedConfig, fit_fd_limit
from exlcli.server.dashboard import LiveDashboard, LogDashboard
from exlcli.server.logs import DropCancelledTracebacks, RepeatLimiter
from exlcli.server.model_pool import ModelPool
from exlcli.server.security import allowed_host_names, check_bind_allowed
from exlcli.server.sse import keep_streams_on_shutdown
from exlcli.server.tracker import RequestTracker


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted sockets only when the proto
    # says TCP, and without it every keep-alive response waits ~40 ms on delayed ACKs.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        running = find_running_server()
        hint = f"; an exlcli server is already running at {running}" if running else "; pick another with --port"
        raise ExlcliError(f"cannot listen on {host}:{port} ({e.strerror or e}){hint}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_for(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"  # the address local clients use to reach an any-address bind
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


# uvicorn's shutdown sleeps this long after asking connections to close, before its timeout runs.
UVICORN_SHUTDOWN_PAUSE_S = 0.1


class DrainingServer(uvicorn.Server):
    """uvicorn, plus: the display runs for the server's whole life (drain included), and a
    signal first puts the app in draining mode (new requests get 503) while uvicorn waits for the
    running ones; a second Ctrl-C forces the exit."""

    def __init__(self, config: uvicorn.Config, state: ServerState, display) -> None:
        super().__init__(config)
        self.state = state
        self.display = display
        self._display_task: asyncio.Task | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self._display_task = asyncio.create_task(self.display.run(self.state))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # The drain: still listening while the running generations finish, so /health answers 503
        # and new requests get a 503 (draining) instead of a refused connection. uvicorn's own
        # shutdown then stops listening and waits for the rest, within what is left of the timeout.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeout_graceful_shutdown
        while self._generating() and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.config.timeout_graceful_shutdown = max(0.05, deadline - loop.time() - UVICORN_SHUTDOWN_PAUSE_S)
        await super().shutdown(sockets)
        if self._display_task is not None:
            self._display_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._display_task

    def _generating(self) -> bool:
        return bool(self.state.tracker.live or self.state.num_starting or self.state.groups)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn's own handler, the signal is not re-raised after shutdown: a drained
        # server exits 0.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
            return
        self.should_exit = True
        if not self.state.draining:
            self.state.draining = True
            running = len(self.state.tracker.live)
            self.display.note(f"{signal.Signals(sig).name}: draining {running} running request(s), then exiting"
                              + (" (Ctrl-C again to stop now)" if sig == signal.SIGINT else ""))


def _configure_logging(console: Console | None) -> None:
    if console is not None:
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=console, show_path=False)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # Under attack the same lines (accept errors, invalid requests, closed connections) come by the
    # thousand: a few of each get through, then one count per interval.
    handler.addFilter(RepeatLimiter())
    handler.addFilter(DropCancelledTracebacks())
    for name, level in (("exlcli", logging.INFO), ("uvicorn.error", logging.WARNING), ("asyncio", logging.WARNING)):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False


def uvicorn_config(app, limits: ConnectionLimits) -> LimitedConfig:
    return LimitedConfig(app, limits, app.state.exlcli.config.max_body_bytes, log_config=None, access_log=False,
                         lifespan="on", ws="none", server_header=False)


def serve(models: EngineClient | ModelPool, sock: socket.socket, host: str, port: int, config: ServerConfig,
          live_display: bool | None = None, limits: ConnectionLimits | None = None) -> None:
    """Serve until a signal; the caller owns `models` (one engine, or a pool) and closes it afterwards."""
    pool = models if isinstance(models, ModelPool) else ModelPool.of_client(models, config.model_aliases)
    default = pool.default.name
    check_bind_allowed(host, config.api_key)
    if config.allowed_hosts is None:
        config = dataclasses.replace(config, allowed_hosts=allowed_host_names(host))
    keep_streams_on_shutdown()  # drain: a SIGTERM lets running streams finish
    url = url_for(host, port)
    console = Console(stderr=True)
    if live_display is None:
        live_display = console.is_terminal and not console.is_dumb_terminal
    display = LiveDashboard(url, console) if live_display else LogDashboard(url)
    _configure_logging(console if live_display else None)
    tracker = RequestTracker(on_finish=display.on_finish, model_name=default)
    app = create_app(pool, config, tracker)
    limits, fd_note = fit_fd_limit(limits or ConnectionLimits())
    if fd_note:
        display.note(fd_note)
    server = DrainingServer(uvicorn_config(app, limits), app.state.exlcli, display)
    fixed = secure_runtime_dir()
    if fixed:
        display.note(fixed)
    write_record(ServerRecord(url=url, pid=os.getpid(), model=default, api_key=config.api_key))
    others = f" and {len(pool.models) - 1} more model(s), loaded on first use" if len(pool.models) > 1 else ""
    display.note(f"serving {default}{others} at {url} "
                 f"(OpenAI API under {url}/v1; Ctrl-C or SIGTERM drains and stops)")
    try:
        server.run(sockets=[sock])
    finally:
        remove_record()
        sock.close()
    display.note("stopped")
