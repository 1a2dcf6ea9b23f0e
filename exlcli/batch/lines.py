"""Input lines -> jobs. Two shapes per line:

native  {"id", "prompt" | "messages", "system"?, "max_tokens"?, "temperature"?, ...}
openai  {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}

A line that can't run becomes a BadLine (line number, code, one clear message) instead of stopping
the file. The file is streamed: only the set of ids seen so far is kept, to catch duplicates.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from exlcli.batch.fields import (OPENAI_EXTRA_PARAM_FIELDS, PARAM_FIELDS, LineError, is_int, wrong_type)
from exlcli.client.base import GenerationParams
from exlcli.errors import RequestError

NATIVE = "native"
OPENAI = "openai"
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"

ROLES = ("system", "user", "assistant", "tool")
# OpenAI body keys that would change what the answer means; refusing beats silently ignoring them.
UNSUPPORTED_BODY_KEYS = ("tools", "tool_choice", "functions", "function_call", "response_format",
                         "logprobs", "top_logprobs", "logit_bias", "suffix", "echo", "audio",
                         "modalities", "prediction")


@dataclass
class LineDefaults:
    """What the command line sets for every line; a line's own fields win."""

    params: GenerationParams = field(default_factory=GenerationParams)
    system: str | None = None  # added to chat lines that have no system message


@dataclass
class Job:
    id: str
    line_no: int
    shape: str  # NATIVE or OPENAI: the output line takes the same shape
    kind: str  # "chat" or "complete"
    params: GenerationParams
    messages: list[dict] | None = None
    prompt: str | None = None


@dataclass
class BadLine:
    id: str
    line_no: int
    shape: str
    code: str
    message: str


def auto_id(line_no: int) -> str:
    return f"line-{line_no}"


def shape_of(obj: dict) -> str:
    return OPENAI if ("custom_id" in obj or "body" in obj or "url" in obj) else NATIVE


def _params(obj: dict, fields: dict, defaults: GenerationParams) -> GenerationParams:
    changes: dict[str, Any] = {"stop": list(defaults.stop)}  # a job's list, not the shared default
    for key, (attr, check) in fields.items():
        if key in obj:
            changes[attr] = check(key, obj[key])
    params = dataclasses.replace(defaults, **changes)
    params.client, params.priority = "batch", "batch"
    try:
        params.sampling()  # ranges (top_p in (0, 1], temperature >= 0, ...)
    except RequestError as e:
        raise LineError("invalid_value", str(e)) from None
    return params


def _content(value: Any, where: str) -> str:
    """Message content: a string, or OpenAI's list of {"type": "text", "text": ...} parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise wrong_type(f"{where}.content", "a string or a list of text parts", value)


def _messages(value: Any, system: str | None, line_system: bool) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise wrong_type("messages", "a non-empty list of {role, content} objects", value)
    messages = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise wrong_type(where, "an object with role and content", m)
        if m.get("role") not in ROLES:
            raise wrong_type(f"{where}.role", "one of " + ", ".join(ROLES), m.get("role"))
        if "content" not in m:
            raise LineError("missing_field", f"{where} has no content")
        messages.append({"role": m["role"], "content": _content(m["content"], where)})
    has_system = messages[0]["role"] == "system"
    if system is not None:
        if has_system and line_system:
            raise LineError("invalid_value", "give system or a system message in messages, not both")
        if not has_system:
            messages.insert(0, {"role": "system", "content": system})
    return messages


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:  # OpenAI allows a list of prompts; one is fine
        value = value[0]
    if not isinstance(value, str):
        raise wrong_type("prompt", "a string", value)
    if not value:
        raise LineError("invalid_value", "prompt is empty")
    return value


def _native_job(obj: dict, job_id: str, line_no: int, defaults: LineDefaults) -> Job:
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise LineError("missing_prompt", "give either prompt or messages" if has_prompt
                        else "line has neither prompt nor messages")
    params = _params(obj, PARAM_FIELDS, defaults.params)
    if has_prompt:
        if "system" in obj:
            raise LineError("invalid_value", "system applies to messages, not to a raw prompt")
        return Job(job_id, line_no, NATIVE, "complete", params, prompt=_prompt(obj["prompt"]))
    system = obj.get("system", defaults.system)
    if system is not None and not isinstance(system, str):
        raise wrong_type("system", "a string", system)
    messages = _messages(obj["messages"], system, "system" in obj)
    return Job(job_id, line_no, NATIVE, "chat", params, messages=messages)


def _openai_job(obj: dict, job_id: str, line_no: int, defaults: LineDefaults) -> Job:
    method = obj.get("method", "POST")
    if method != "POST":
        raise LineError("invalid_value", f"method must be POST, got {json.dumps(method)[:40]}")
    url = obj.get("url")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise LineError("invalid_value", f"url must be {CHAT_URL} or {COMPLETIONS_URL}, got {json.dumps(url)[:60]}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise wrong_type("body", "an object", body)
    unsupported = [k for k in UNSUPPORTED_BODY_KEYS if body.get(k) not in (None, False, [], {})]
    if unsupported:
        raise LineError("unsupported", f"body.{unsupported[0]} is not supported by exlcli batch")
    if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
        raise LineError("unsupported", "only n = 1 is supported")
    params = _params(body, {**PARAM_FIELDS, **OPENAI_EXTRA_PARAM_FIELDS}, defaults.params)
    if url == CHAT_URL:
        if "messages" not in body:
            raise LineError("missing_prompt", "body has no messages")
        messages = _messages(body["messages"], defaults.system, False)
        return Job(job_id, line_no, OPENAI, "chat", params, messages=messages)
    if "prompt" not in body:
        raise LineError("missing_prompt", "body has no prompt")
    return Job(job_id, line_no, OPENAI, "complete", params, prompt=_prompt(body["prompt"]))


def _line_id(obj: dict, shape: str, line_no: int) -> str:
    key = "custom_id" if shape == OPENAI else "id"
    value = obj.get(key)
    if value is None:
        return auto_id(line_no)
    if is_int(value):
        return str(value)
    if isinstance(value, str) and value:
        return value
    raise wrong_type(key, "a non-empty string", value)


def parse_line(raw: bytes, line_no: int, defaults: LineDefaults, file_shape: str) -> Job | BadLine:
    """One input line (without its newline) -> a Job, or a BadLine saying what is wrong."""
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError:
        return BadLine(auto_id(line_no), line_no, file_shape, "invalid_utf8", "line is not valid UTF-8")
    except json.JSONDecodeError as e:
        return BadLine(auto_id(line_no), line_no, file_shape, "invalid_json",
                       f"line is not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return BadLine(auto_id(line_no), line_no, file_shape, "invalid_type",
                       f"line must be a JSON object, got {type(obj).__name__}")
    shape = shape_of(obj)
    try:
        job_id = _line_id(obj, shape, line_no)
    except LineError as e:
        return BadLine(auto_id(line_no), line_no, shape, e.code, e.message)
    try:
        build = _openai_job if shape == OPENAI else _native_job
        return build(obj, job_id, line_no, defaults)
    except LineError as e:
        return BadLine(job_id, line_no, shape, e.code, e.message)


def _numbered_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line without its end) for each non-blank line, streamed."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            raw = raw.rstrip(b"\r\n")
            if raw.strip():
                yield line_no, raw


def count_lines(path: Path) -> int:
    """Non-blank lines: the progress bar's total (one cheap pass, nothing parsed)."""
    return sum(1 for _ in _numbered_lines(path))


def detect_shape(path: Path) -> str:
    """The shape of the first line that parses; it is the shape of error lines for unparsable ones."""
    for _, raw in _numbered_lines(path):
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return shape_of(obj)
    return NATIVE


def read_jobs(path: Path, defaults: LineDefaults) -> Iterator[Job | BadLine]:
    """Every non-blank line of `path` in order; a repeated id becomes a BadLine (the first runs)."""
    file_shape = detect_shape(path)
    first_line: dict[str, int] = {}
    for line_no, raw in _numbered_lines(path):
        item = parse_line(raw, line_no, defaults, file_shape)
        if item.id in first_line:
            yield BadLine(item.id, line_no, item.shape, "duplicate_id",
                          f"id {item.id!r} already used on line {first_line[item.id]}")
            continue
        first_line[item.id] = line_no
        yield item
