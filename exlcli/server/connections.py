"""What uvicorn lacks against idle and slow sockets: a cap on open connections that fits the
process's file-descriptor limit, deadlines for a request's headers and for its body, and limits on
the headers' size and count.

uvicorn's own keep-alive timer runs only between requests and is cancelled by any byte received, so
a client sending its headers or its body a byte at a time would hold a socket forever. At the cap,
a new connection takes the place of the one that has waited longest on its client (idle between
requests, or still sending headers or a body); only when every connection is busy with a response
is the new one closed at accept. So slow clients cannot crowd out fast ones: they hold a slot only
until newer connections need it, and never past their deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import resource
import time
from dataclasses import dataclass, replace

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

log = logging.getLogger("exlcli.server")

# File descriptors kept for what is not a connection: the listening socket, the model's files,
# logs, the grammar workers' pipes, the runtime file.
RESERVED_FDS = 64
# After an early answer (a 413 from Content-Length) the rest of the body is read and dropped for at
# most this long, so the client, still sending, reads the answer instead of a connection reset.
EARLY_ANSWER_GRACE_S = 2.0


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 1024  # beyond this, see the module's docstring
    header_timeout_s: float = 10.0  # a request's headers must be complete within this
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    drain_timeout_s: float = 30.0  # on SIGTERM, streams still open after this are closed
    body_timeout_s: float = 30.0  # a request's body must be complete within this after its headers
    max_header_bytes: int = 16 * 1024  # the request line and headers together
    max_headers: int = 100

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_header_bytes", "max_headers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "keep_alive_s", "drain_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def fit_fd_limit(limits: ConnectionLimits) -> tuple[ConnectionLimits, str | None]:
    """The limits with a connection cap the process can hold: the soft file-descriptor limit is
    raised toward the hard one as far as the cap needs; a cap beyond even that is lowered (a note
    says so). Past the fd limit, accept() would fail and no file could be opened."""
    needed = limits.max_connections + RESERVED_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return limits, None
    fitted = max(1, soft - RESERVED_FDS)
    return replace(limits, max_connections=fitted), (
        f"--max-connections {limits.max_connections} is more than this process's file-descriptor limit allows "
        f"({soft}, less {RESERVED_FDS} kept for files): serving at most {fitted} connections (raise it with ulimit -n)")


class LimitedConfig(uvicorn.Config):
    """uvicorn's Config with exlcli's limits, read by GuardedH11Protocol."""

    def __init__(self, app, limits: ConnectionLimits, max_body_bytes: int | None = None, **kwargs) -> None:
        super().__init__(app, http=GuardedH11Protocol, timeout_keep_alive=limits.keep_alive_s,
                         timeout_graceful_shutdown=limits.drain_timeout_s,
                         h11_max_incomplete_event_size=limits.max_header_bytes, **kwargs)
        self.limits = limits
        self.max_body_bytes = max_body_bytes  # the app's (it answers 413 itself for lengths h11 takes)


_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length[ \t]*:[ \t]*([0-9]+)[ \t]*\r\n", re.IGNORECASE)


def _declared_length(head: bytes) -> int | None:
    """The Content-Length in raw request headers, however long (None: none, or not a number)."""
    match = _CONTENT_LENGTH.search(head.split(b"\r\n\r\n", 1)[0] + b"\r\n")
    return int(match.group(1)) if match else None


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus the connection cap, the header and body deadlines (one timer:
    armed while the connection waits on its client, disarmed while the app answers) and the header
    limits."""

    def __init__(self, config: LimitedConfig, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.limits = config.limits
        self.max_body_bytes = config.max_body_bytes
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind: str | None = None
        self.waiting_since: float | None = None  # waiting on the client since (None: the app is answering)
        self._header_bytes = 0  # received while waiting for a request's headers
        self._head = bytearray()  # their first bytes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections and not self._make_room():
            log.warning("%d connections are open and busy (--max-connections): closing new ones",
                        self.limits.max_connections)
            transport.abort()
            return
        self._update_timer()

    def _make_room(self) -> bool:
        waiting = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)
                   and c.waiting_since is not None and not c.transport.is_closing()]
        if not waiting:
            return False
        min(waiting, key=lambda c: c.waiting_since).evict()  # type: ignore[arg-type, return-value]
        return True

    def evict(self) -> None:
        """Closed to make room for a new connection."""
        self._set_timer(None)
        self.connections.discard(self)  # counted out now; the close completes on the next loop turn
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_timer(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._header_bytes += len(data)
            if len(self._head) <= self.limits.max_header_bytes:  # kept to name what h11 refuses
                self._head += data[:self.limits.max_header_bytes + 1 - len(self._head)]
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.transport.is_closing():
            return
        if self.cycle is not cycle and self.cycle is not None:  # a request's headers are in
            # (h11's own size limit holds only for headers that arrive in pieces)
            size = len(self.scope["raw_path"]) + len(self.scope["query_string"]) \
                + sum(len(k) + len(v) + 4 for k, v in self.headers)
            if size > self.limits.max_header_bytes:
                self._refuse(431, f"the request's headers are larger than {self.limits.max_header_bytes} bytes")
                return
            if len(self.headers) > self.limits.max_headers:
                self._refuse(431, f"a request may have at most {self.limits.max_headers} header fields")
                return
        self._update_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._update_timer()

    def _update_timer(self) -> None:
        """The timer for what the connection waits on: the client's headers, its body, the rest of a
        body already answered (a 413), or nothing while the app answers."""
        state = self.conn.their_state
        answered = self.cycle is None or self.cycle.response_complete
        if state is h11.SEND_BODY:
            self._set_timer("drop" if answered else "body")
        elif state is h11.IDLE and answered:
            self._set_timer("headers")
        else:
            self._set_timer(None)

    def _set_timer(self, kind: str | None) -> None:
        if kind == self._timer_kind:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if kind is None:
            self.waiting_since = None
        else:
            if kind == "headers" or self.waiting_since is None:
                self.waiting_since = time.monotonic()
            if kind == "headers":
                self._header_bytes = 0
                self._head = bytearray()
            seconds, callback = {"headers": (self.limits.header_timeout_s, self._close),
                                 "body": (self.limits.body_timeout_s, self._body_too_slow),
                                 "drop": (EARLY_ANSWER_GRACE_S, self._close)}[kind]
            self._timer = self.loop.call_later(seconds, callback)
        self._timer_kind = kind

    def _close(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def _body_too_slow(self) -> None:
        self._timer = None
        if self.cycle is not None and not self.cycle.response_started:
            self._refuse(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s")
        else:
            self._close()

    def send_400_response(self, msg: str) -> None:
        # h11 refused the request; where it was for its size, say which limit (h11 takes no
        # Content-Length of more than 20 digits: 10**20 is a body too large, not a bad request)
        if self._header_bytes > self.limits.max_header_bytes:
            self._refuse(431, f"the request's headers are larger than {self.limits.max_header_bytes} bytes")
            return
        declared = _declared_length(bytes(self._head))
        if declared is not None and self.max_body_bytes is not None and declared > self.max_body_bytes:
            self._refuse(413, f"request body is larger than the limit of {self.max_body_bytes} bytes")
            return
        super().send_400_response(msg)

    def _refuse(self, status: int, message: str) -> None:
        """An OpenAI-style error and the connection closed, before the app has answered."""
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": None}}).encode()
        if self.cycle is not None and not self.cycle.response_started:
            self.cycle.response_started = self.cycle.response_complete = True  # the app's answer is dropped
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        try:
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            self.transport.write(self.conn.send(h11.Response(status_code=status, reason=STATUS_PHRASES[status],
                                                             headers=headers)))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:
            pass  # a response was already under way: only the close is left
        self._set_timer(None)
        self.transport.close()
