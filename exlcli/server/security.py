"""Who may reach the server and how much they may send: loopback by default, a Host allow-list
there (against DNS rebinding), API keys compared in constant time and checked before any body is
read, and a cap on request body size enforced before the body is read into memory."""

from __future__ import annotations

import hashlib
import hmac
import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exlcli.client.runtime_file import is_loopback_host
from exlcli.errors import ExlcliError
from exlcli.server.anthropic_errors import anthropic_error_body, is_messages_path

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MIN_PUBLIC_KEY_CHARS = 16
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def check_bind_allowed(host: str, api_key: str | None) -> None:
    if is_loopback_host(host):
        return
    if not api_key:
        raise ExlcliError(
            f"refusing to listen on {host} without an API key: anyone who can reach this machine could "
            "use the model. Pass --api-key KEY (or set EXLCLI_API_KEY), or bind 127.0.0.1")
    if len(api_key) < MIN_PUBLIC_KEY_CHARS:
        raise ExlcliError(
            f"refusing to listen on {host} with a key of {len(api_key)} characters: a key for a public address "
            f"needs at least {MIN_PUBLIC_KEY_CHARS} (e.g. python -c 'import secrets; print(secrets.token_urlsafe())')")


def allowed_host_names(host: str) -> tuple[str, ...] | None:
    """Host header names a server bound to `host` answers: for loopback, the local names and the
    bound address (a web page on another name that resolves to 127.0.0.1 is DNS rebinding);
    elsewhere any, since the key guards it."""
    if not is_loopback_host(host):
        return None
    return tuple(dict.fromkeys((*LOOPBACK_NAMES, host.strip("[]").lower())))


def _error(scope: Scope, status: int, message: str, code: str,
           headers: list[tuple[bytes, bytes]] = ()) -> list[Message]:
    """The error's messages, in the shape of the API whose route `scope` asks for."""
    if is_messages_path(scope.get("path", "")):
        shaped = anthropic_error_body(status, message)
    else:
        shaped = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    body = json.dumps(shaped).encode()
    return [{"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]},
        {"type": "http.response.body", "body": body}]


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope.get("headers", []) if k == name), None)


def _host_name(value: bytes) -> str:
    host = value.decode("latin-1").strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class HostAllowList:
    """ASGI middleware: 400 for a Host header not in `allowed` (any port)."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app = app
        self.allowed = frozenset(h.lower() for h in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = _header(scope, b"host")
            if host is None or _host_name(host) not in self.allowed:
                names = ", ".join(sorted(self.allowed))
                for message in _error(scope, 400, f"this server answers only requests for {names} in the Host header",
                                      "invalid_host"):
                    await send(message)
                return
        await self.app(scope, receive, send)


class APIKeyGate:
    """ASGI middleware: 401 unless 'Authorization: Bearer KEY' or 'x-api-key: KEY' (Anthropic's
    clients send that), on every path but `open_paths`, checked before the app reads (or parses)
    any of the body."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self.api_key = api_key
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") not in self.open_paths and scope.get("method") != "OPTIONS":
            if not key_matches(request_api_key(_text_header(scope, b"authorization"),
                                               _text_header(scope, b"x-api-key")), self.api_key):
                for message in _error(scope, 401, "missing or invalid API key (send 'Authorization: Bearer KEY' "
                                      "or 'x-api-key: KEY')", "invalid_api_key", [(b"www-authenticate", b"Bearer")]):
                    await send(message)
                return
        await self.app(scope, receive, send)


def key_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison, so response timing leaks nothing about the key."""
    return hmac.compare_digest((given or "").encode("utf-8", "replace"), expected.encode("utf-8"))


def scoped_session(api_key: str | None, session: str) -> str:
    """The engine's name for a request's session: with an API key, the name lives under that key
    (a digest of it), so the same name sent with another key is another session, and the engine's
    names never hold a key."""
    if not api_key:
        return session
    return hashlib.sha256(api_key.encode("utf-8", "replace")).hexdigest()[:16] + "/" + session


def _text_header(scope: Scope, name: bytes) -> str | None:
    value = _header(scope, name)
    return value.decode("latin-1") if value is not None else None


def request_api_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """The key a request brings: 'Authorization: Bearer KEY' (OpenAI's clients), else 'x-api-key'
    (Anthropic's)."""
    return bearer_token(authorization) or (x_api_key.strip() if x_api_key else None)


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


class BodySizeLimit:
    """ASGI middleware: 413 for a body over `max_bytes`, judged by Content-Length up front (at once,
    whatever the length says, 10**20 included) and by counting while it streams in (a chunked body
    has no length). The answer does not wait for the rest of the body: the connection
    (connections.py) reads and drops it, for a short while, so the client still reads the 413."""

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
                    await self._reject(scope, send)
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
                await self._reject(scope, send)

    async def _reject(self, scope: Scope, send: Send) -> None:
        for message in _error(scope, 413, f"request body is larger than the limit of {self.max_bytes} bytes",
                              "request_too_large"):
            await send(message)


class _BodyTooLarge(HTTPException):
    # An HTTPException so that FastAPI, which turns other errors met while reading a body into a
    # 400, passes it on to the error handler as the 413 it is.
    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body is larger than the limit of {max_bytes} bytes")
