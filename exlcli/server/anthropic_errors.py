"""Errors in Anthropic's shape, {"type": "error", "error": {"type", "message"}}, for the routes of its
Messages API (the OpenAI routes keep OpenAI's shape). Anthropic's body has no `param`: the field at
fault is named at the start of the message."""

from __future__ import annotations

MESSAGES_PATH = "/v1/messages"  # and every path under it (count_tokens)

# Anthropic's error type for each status it uses; 503 (busy, draining) is its overloaded_error.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_body(status: int, message: str, param: str | None = None) -> dict:
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": error_type(status), "message": message}}
