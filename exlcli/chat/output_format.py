"""`/format`: hold the chat's answers to JSON, a JSON Schema file, a regex or a grammar file."""

from __future__ import annotations

import json

from exlcli.engine.constraints import check_json_schema
from exlcli.engine.request import GrammarSpec
from exlcli.errors import ExlcliError, RequestError

USAGE = "/format [json | schema FILE | regex R | grammar FILE | off]"


class FormatError(ExlcliError):
    pass


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise FormatError(f"cannot read {path}: {e.strerror or e}") from None


def parse_format(arg: str) -> GrammarSpec | None:
    """The constraint `/format ARG` asks for (None: answers are free again)."""
    kind, _, value = arg.strip().partition(" ")
    kind, value = kind.lower(), value.strip()
    if kind in ("off", "text", "none"):
        return None
    if kind in ("json", "json_object"):
        return GrammarSpec("json_object")
    if kind not in ("schema", "regex", "grammar") or not value:
        raise FormatError(f"use {USAGE}")
    if kind == "regex":
        return GrammarSpec("regex", value)
    text = _read(value)
    if kind == "grammar":
        return GrammarSpec("grammar", text)
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise FormatError(f"{value} is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise FormatError(f"{value} does not hold a JSON Schema object")
    try:
        check_json_schema(schema)
    except RequestError as e:
        raise FormatError(f"{value}: {e}") from None
    return GrammarSpec("json_schema", schema, strict=False)


def describe(spec: GrammarSpec | None) -> str:
    if spec is None:
        return "free text"
    if spec.kind == "json_object":
        return "a JSON object"
    if spec.kind == "json_schema":
        return f"JSON under a schema ({len(json.dumps(spec.value))} characters)"
    if spec.kind == "regex":
        return f"text matching the regex {spec.value!r}"
    return f"text in a grammar ({len(str(spec.value))} characters)"
