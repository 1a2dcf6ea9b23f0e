"""Server-sent events: encoding, and a response that notices a client leaving at once.

Starlette's StreamingResponse only learns of a disconnect when it next writes, which for a request
still waiting in the engine's queue may be many seconds away. This response listens for
`http.disconnect` alongside the stream and calls `on_disconnect` right away, so the engine frees the
request's pages even before its first token.
"""

from __future__ import annotations

import json
from typing import AsyncIterator, Callable

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def sse_data(payload: dict) -> bytes:
    # ensure_ascii keeps every byte ASCII, so no text the engine makes can break the encoding.
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode("ascii") + b"\n\n"


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], None],
                 headers: dict[str, str] | None = None) -> None:
        # Not Response.__init__: it would render an empty body and send Content-Length: 0.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._events = events
        self._on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async with anyio.create_task_group() as group:

            async def pump() -> None:
                try:
                    async for chunk in self._events:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:  # the socket went away mid-write
                    self._on_disconnect()
                finally:
                    group.cancel_scope.cancel()

            async def watch() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        self._on_disconnect()
                        group.cancel_scope.cancel()
                        return

            group.start_soon(pump)
            group.start_soon(watch)
        # Close the generator here, in this task, so its `finally` (which cancels the engine
        # streams) runs now rather than whenever it is garbage-collected.
        aclose = getattr(self._events, "aclose", None)
        if aclose is not None:
            with anyio.CancelScope(shield=True):
                await aclose()
