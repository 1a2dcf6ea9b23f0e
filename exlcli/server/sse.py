"""Server-sent events through sse-starlette: OpenAI's encoding (`data: {...}\n\n`, then
`data: [DONE]\n\n`), keep-alive pings (`: ping ...` comment lines, which SSE clients skip) while a
request waits in the engine's queue, and a client leaving noticed at once.

sse-starlette listens for `http.disconnect` alongside the stream and calls the close handler right
away, so the engine frees a request's pages even before its first token. Its own "cut every stream
on SIGTERM" is turned off by `keep_streams_on_shutdown`: exlcli drains, letting running requests
finish.
"""

from __future__ import annotations

import json
from typing import AsyncIterator, Callable

from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import AppStatus
from starlette.types import Message

SEP = "\n"  # OpenAI's servers and SDKs use LF; sse-starlette's default is CRLF
DEFAULT_PING_S = 15.0


def sse_data(payload: dict) -> bytes:
    # ensure_ascii keeps every byte ASCII and the JSON on one line, so no text the engine makes can
    # break the encoding.
    return ServerSentEvent(data=json.dumps(payload, separators=(",", ":")), sep=SEP).encode()


DONE = ServerSentEvent(data="[DONE]", sep=SEP).encode()


def keep_streams_on_shutdown() -> None:
    """sse-starlette ends every open stream once uvicorn's should_exit is set; a draining exlcli
    server sets it on the first SIGTERM yet wants the running streams to finish. A process-wide
    switch of the library's, so the server's runner calls it once, not the app."""
    AppStatus.disable_automatic_graceful_drain()


def sse_event(event: str, payload: dict) -> bytes:
    """A named event (`event: NAME` then `data: {...}`), as Anthropic's API sends each one."""
    return ServerSentEvent(data=json.dumps(payload, separators=(",", ":")), event=event, sep=SEP).encode()


PingFactory = Callable[[], ServerSentEvent]


class EventStreamResponse(EventSourceResponse):
    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], None],
                 headers: dict[str, str] | None = None, ping_s: float = DEFAULT_PING_S,
                 ping_factory: PingFactory | None = None) -> None:
        """`ping_factory`: the keep-alive event (None: a `: ping` comment)."""
        async def closed(_message: Message) -> None:
            on_disconnect()

        super().__init__(events, headers=headers, ping=ping_s, sep=SEP, client_close_handler_callable=closed,
                         ping_message_factory=ping_factory)
