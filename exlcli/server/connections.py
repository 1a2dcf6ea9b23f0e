"""What uvicorn lacks against idle and slow sockets: a cap on open connections, enforced at accept
(the socket is closed at once, so file descriptors stay free for real clients), and a deadline for a
request's headers. uvicorn's own keep-alive timer runs only between requests and is cancelled by any
byte received, so a client sending its headers a byte at a time would hold a socket forever."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("exlcli.server")


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 1024  # beyond this, new sockets are closed as they are accepted
    header_timeout_s: float = 10.0  # a request's headers must be complete within this
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    drain_timeout_s: float = 30.0  # on SIGTERM, streams still open after this are closed

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        for name in ("header_timeout_s", "keep_alive_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class LimitedConfig(uvicorn.Config):
    """uvicorn's Config with exlcli's limits, read by GuardedH11Protocol."""

    def __init__(self, app, limits: ConnectionLimits, **kwargs) -> None:
        super().__init__(app, http=GuardedH11Protocol, timeout_keep_alive=limits.keep_alive_s,
                         timeout_graceful_shutdown=limits.drain_timeout_s, **kwargs)
        self.limits = limits


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus the connection cap and the header deadline (armed when the
    connection opens and after each response, disarmed when a request's headers are complete)."""

    def __init__(self, config: LimitedConfig, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.limits = config.limits
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            log.warning("%d connections are open (--max-connections): closing new ones", self.limits.max_connections)
            transport.abort()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and self.cycle is not None:  # a request's headers are in
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()
