"""Type checks for the fields of an input line; each returns the clean value or raises LineError."""

from __future__ import annotations

import json
import math
from typing import Any

from exlcli.batch.failures import LineError
from exlcli.engine.context_window import OVERFLOW_MODES
from exlcli.engine.request import GrammarSpec, grammar_from_response_format
from exlcli.errors import RequestError

INT_LIMIT = 2 ** 63  # integers must fit in 64 bits: the engine, the server and JSON readers all assume so


def preview(value: Any, limit: int = 60) -> str:
    """A short JSON rendering of a value for a message; never raises."""
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def wrong_type(name: str, want: str, value: Any) -> LineError:
    return LineError("invalid_type", f"{name} must be {want}, got {preview(value)}")


def is_int(value: Any) -> bool:
    """An integer that fits in 64 bits (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and -INT_LIMIT <= value < INT_LIMIT


def _number(name: str, value: Any) -> float:
    if not (is_int(value) or (isinstance(value, float) and math.isfinite(value))):
        raise wrong_type(name, "a finite number", value)
    return float(value)


def _integer(name: str, value: Any) -> int:
    if not is_int(value):
        raise wrong_type(name, "an integer of at most 64 bits", value)
    return value


def _max_tokens(name: str, value: Any) -> int:
    if not is_int(value) or value < 1:
        raise wrong_type(name, "a positive integer of at most 64 bits", value)
    return value


def _seed(name: str, value: Any) -> int | None:
    return None if value is None else _integer(name, value)


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
    if value is not None and (not is_int(value) or value < 0):
        raise wrong_type(name, "an integer >= 0", value)
    return value


GRAMMAR_KEYS = ("json_schema", "regex", "grammar", "response_format")

# line key -> (GenerationParams field, check)
PARAM_FIELDS = {
    "max_tokens": ("max_tokens", _max_tokens),
    "temperature": ("temperature", _number),
    "top_p": ("top_p", _number),
    "top_k": ("top_k", _integer),
    "min_p": ("min_p", _number),
    "seed": ("seed", _seed),
    "stop": ("stop", _stop),
    **{key: ("grammar", _grammar) for key in GRAMMAR_KEYS},
    "speculative": ("speculative", _speculative),
    "context_overflow": ("context_overflow", _context_overflow),  # past the window: stop / shift / sinks
    "sink_tokens": ("sink_tokens", _count),
    "window": ("window", _count),
}
OPENAI_EXTRA_PARAM_FIELDS = {
    "max_completion_tokens": ("max_tokens", _max_tokens),
    "presence_penalty": ("presence_penalty", _number),
    "frequency_penalty": ("frequency_penalty", _number),
    "repetition_penalty": ("repetition_penalty", _number),
}
