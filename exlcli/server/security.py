"""Who may reach the server and how much they may send: loopback by default, API keys compared in
constant time, and a cap on request body size enforced before the body is read into memory."""

from __future__ import annotations

import hmac
import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exlcli.client.runtime_file import is_loopback_host
from exlcli.errors import ExlcliError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


def check_bind_allowed(host: str, api_key: str | None) -> None:
    if not is_loopback_host(host) and not api_key:
        raise ExlcliError(
            f"refusing to listen on {host} without an API key: anyone who can reach this machine could "
            "use the model. Pass --api-key KEY (or set EXLCLI_API_KEY), or bind 127.0.0.1")


def key_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison, so response timing leaks nothing about the key."""
    return hmac.compare_digest((given or "").encode("utf-8", "replace"), expected.encode("utf-8"))


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


class BodySizeLimit:
    """ASGI middleware: 413 for a body over `max_bytes`, judged by Content-Length up front and by
    counting while it streams in (a chunked body has no length)."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False  # the HTTP server rejects a malformed length itself
                if too_big:
                    await self._reject(send)
                    return
        received = 0
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not response_started:
                await self._reject(send)

    async def _reject(self, send: Send) -> None:
        body = json.dumps({"error": {
            "message": f"request body is larger than the limit of {self.max_bytes} bytes",
            "type": "invalid_request_error", "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(HTTPException):
    # An HTTPException so that FastAPI, which turns other errors met while reading a body into a
    # 400, passes it on to the error handler as the 413 it is.
    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body is larger than the limit of {max_bytes} bytes")
