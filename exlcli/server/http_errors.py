"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, with the status
OpenAI uses (400 for a bad body where FastAPI would say 422); on the routes of Anthropic's Messages
API, in Anthropic's shape (anthropic_errors.py)."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from exlcli.errors import ExlcliError
from exlcli.server import openai_format as fmt
from exlcli.server.anthropic_errors import anthropic_error_body, is_messages_path
from exlcli.server.schemas import ParamError

log = logging.getLogger("exlcli.server")

# The engine's (and the fake's) words for a prompt that does not fit: "prompt is N tokens, longer
# than the context of M" / "... longer than the model's context of M".
_CONTEXT_EXCEEDED = re.compile(r"longer than the (model's )?context")


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def response(self, path: str = "") -> JSONResponse:
        """The error as the API of the route at `path` spells it."""
        if is_messages_path(path):
            body = anthropic_error_body(self.status, self.message, self.param)
        else:
            body = fmt.error_body(self.message, self.kind, self.param, self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers a bad body with 400 and one message, not FastAPI's 422 with a list.
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            detail = first.get("ctx", {}).get("error", "")
            return APIError(400, f"the body is not valid JSON: {detail}".rstrip(": ")).response(request.url.path)
        message = first.get("msg", "invalid value").removeprefix("Value error, ")
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, ParamError):  # a check across fields that names its own field
            return APIError(400, message, param=cause.param).response(request.url.path)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        return APIError(400, f"{param}: {message}" if param else message, param=param).response(request.url.path)

    @app.exception_handler(ExlcliError)
    async def refused(request: Request, exc: ExlcliError) -> JSONResponse:
        # RequestError from the engine: prompt too long, bad parameters
        message = str(exc)
        if _CONTEXT_EXCEEDED.search(message):
            path = request.url.path
            param = "messages" if path.endswith("/chat/completions") or is_messages_path(path) \
                else "input" if path.endswith("/responses") else "prompt"
            return APIError(400, message, param=param, code="context_length_exceeded").response(request.url.path)
        return APIError(400, message).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = APIError(exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {}))
        return error.response(request.url.path)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", "server_error").response(request.url.path)
