"""Type checks for the fields of an input line; each returns the clean value or raises LineError."""

from __future__ import annotations

import json
from typing import Any, Callable

from exlcli.batch.failures import LineError
from exlcli.engine.context_window import OVERFLOW_MODES
from exlcli.engine.request import GrammarSpec, grammar_from_response_format
from exlcli.engine.sampling import API_PARAMS, MAX_TOKENS, Param, ParamError, is_int64
from exlcli.errors import RequestError


def preview(value: Any, limit: int = 60) -> str:
    """A short JSON rendering of a value for a message; never raises."""
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def wrong_type(name: str, want: str, value: Any) -> LineError:
    return LineError("invalid_type", f"{name} must be {want}, got {preview(value)}")


def _param(param: Param) -> Callable[[str, Any], Any]:
    """A check through the parameter's own rule (exlcli.engine.sampling), the value shown as JSON."""
    def check(name: str, value: Any) -> Any:
        try:
            return param.check(value, name)
        except ParamError as e:
            raise LineError(e.code, f"{name} must be {e.rule}, got {preview(value)}") from None
    return check


def _stop(name: str, value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise wrong_type(name, "a non-empty string or a list of them", value)
    return list(value)


def _grammar(name: str, value: Any) -> GrammarSpec | None:
    """json_schema (a schema object), regex, grammar (Lark or GBNF text), or response_format."""
    if value is None:
        return None
    try:
        if name == "response_format":
            return grammar_from_response_format(value)
        if name == "json_schema":
            if not isinstance(value, (dict, bool)):
                raise wrong_type(name, "a JSON Schema object", value)
            return GrammarSpec("json_schema", value)
        return GrammarSpec(name, value)
    except RequestError as e:
        raise LineError("invalid_value", str(e)) from None


def _speculative(name: str, value: Any) -> bool | None:
    """false: no speculative decoding for this line (true or absent: the engine's choice)."""
    if value is not None and not isinstance(value, bool):
        raise wrong_type(name, "true or false", value)
    return value


def _context_overflow(name: str, value: Any) -> str | None:
    if value is not None and value not in OVERFLOW_MODES:
        raise wrong_type(name, " or ".join(OVERFLOW_MODES), value)
    return value


def _count(name: str, value: Any) -> int | None:
    if value is not None and (not is_int64(value) or value < 0):
        raise wrong_type(name, "an integer >= 0", value)
    return value


GRAMMAR_KEYS = ("json_schema", "regex", "grammar", "response_format")

# line key -> (GenerationParams field, check). The generation parameters are all read by their own
# names (logprobs aside: batch output has no place for them, see lines.UNSUPPORTED_BODY_KEYS).
PARAM_FIELDS = {
    **{p.name: (p.name, _param(p)) for p in API_PARAMS},
    "stop": ("stop", _stop),
    **{key: ("grammar", _grammar) for key in GRAMMAR_KEYS},
    "speculative": ("speculative", _speculative),
    "context_overflow": ("context_overflow", _context_overflow),  # past the window: stop / shift / sinks
    "sink_tokens": ("sink_tokens", _count),
    "window": ("window", _count),
}
OPENAI_EXTRA_PARAM_FIELDS = {
    "max_completion_tokens": ("max_tokens", _param(MAX_TOKENS)),
}
