"""Strict JSON lines, both ways: what is read must be writable again, and what is written is JSON
any reader takes (UTF-8, no NaN or Infinity, no lone surrogates)."""

from __future__ import annotations

import json
from typing import Any

from exlcli.batch.failures import LineError


def _no_constant(name: str) -> Any:
    raise LineError("invalid_json", f"{name} is not valid JSON; use null or a number")


def load_line(raw: bytes) -> Any:
    """One line -> a Python value, or raise (the caller routes it through line_error)."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise LineError("invalid_json", f"line cannot be read as JSON ({str(e).split(':')[0]})") from None


def dump_line(value: Any) -> bytes:
    """A value -> one line of strict JSON in UTF-8, newline included; raises if it has none."""
    return (json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n").encode("utf-8")
