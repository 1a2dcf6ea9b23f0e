"""Type checks for the fields of an input line; each returns the clean value or raises LineError."""

from __future__ import annotations

import json
import math
from typing import Any


class LineError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def wrong_type(name: str, want: str, value: Any) -> LineError:
    return LineError("invalid_type", f"{name} must be {want}, got {json.dumps(value)[:60]}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise wrong_type(name, "a number", value)
    return float(value)


def _integer(name: str, value: Any) -> int:
    if not is_int(value):
        raise wrong_type(name, "an integer", value)
    return value


def _max_tokens(name: str, value: Any) -> int:
    if not is_int(value) or value < 1:
        raise wrong_type(name, "a positive integer", value)
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


# line key -> (GenerationParams field, check)
PARAM_FIELDS = {
    "max_tokens": ("max_tokens", _max_tokens),
    "temperature": ("temperature", _number),
    "top_p": ("top_p", _number),
    "top_k": ("top_k", _integer),
    "min_p": ("min_p", _number),
    "seed": ("seed", _seed),
    "stop": ("stop", _stop),
}
OPENAI_EXTRA_PARAM_FIELDS = {
    "max_completion_tokens": ("max_tokens", _max_tokens),
    "presence_penalty": ("presence_penalty", _number),
    "frequency_penalty": ("frequency_penalty", _number),
    "repetition_penalty": ("repetition_penalty", _number),
}
