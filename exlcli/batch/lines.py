"""Input lines -> jobs. Two shapes per line:

native  {"id", "prompt" | "messages", "system"?, "max_tokens"?, "temperature"?, ...}
openai  {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}

A line that can't run becomes a BadLine (line number, code, one clear message) instead of stopping
the file: parse_line never raises, whatever the line holds (see failures.line_error). The file is
streamed: only the set of ids seen so far is kept, to catch duplicates.

Automatic ids: a line without one gets `line-N`, unless some line of the file claims `line-N` as
its own id; then it gets `line-N-auto` (or `line-N-auto2`, ...), the first name nobody claims. A
first pass over the file (scan_input) finds the claims, so an automatic id never collides with a
user's id, and the same file always gives the same ids: a resume is exact.

A half-written last line: the file's last line, when it has no newline and is not whole JSON, is
taken as still being written (a producer appending to the file while the job reads it). It becomes
an UnfinishedLine: not run, not written as an error line, left out of the count, so the rerun
after the writer finishes answers it. A last line without a newline that is whole JSON runs as
usual (editors often leave the newline off), and one that is whole JSON but wrong is its error
line as anywhere else. A file that really ends in a broken line without a newline is reported by
every run, never turned into a lasting error: adding the newline (or fixing the line) settles it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from exlcli.batch.failures import LineError, io_errors, line_error
from exlcli.batch.fields import GRAMMAR_KEYS, OPENAI_EXTRA_PARAM_FIELDS, PARAM_FIELDS, preview, wrong_type
from exlcli.batch.jsonl import dump_line, load_line
from exlcli.client.base import GenerationParams
from exlcli.engine.sampling import is_int64
from exlcli.errors import RequestError

NATIVE = "native"
OPENAI = "openai"
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"

ROLES = ("system", "user", "assistant", "tool")
# OpenAI body keys that would change what the answer means; refusing beats silently ignoring them.
UNSUPPORTED_BODY_KEYS = ("tools", "tool_choice", "functions", "function_call",
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


@dataclass
class UnfinishedLine:
    """The last line of the input, without its newline and not whole JSON: still being written."""

    line_no: int


AUTO_PREFIX = "line-"
UTF8_BOM = b"\xef\xbb\xbf"


def auto_id(line_no: int, claimed: frozenset[str] = frozenset()) -> str:
    """The id of a line that has none: `line-N`, or the first `line-N-auto[K]` no line claims."""
    candidate, k = f"{AUTO_PREFIX}{line_no}", 1
    while candidate in claimed:
        candidate = f"{AUTO_PREFIX}{line_no}-auto{k if k > 1 else ''}"
        k += 1
    return candidate


def shape_of(obj: dict) -> str:
    return OPENAI if ("custom_id" in obj or "body" in obj or "url" in obj) else NATIVE


def _params(obj: dict, fields: dict, defaults: GenerationParams) -> GenerationParams:
    changes: dict[str, Any] = {"stop": list(defaults.stop)}  # a job's list, not the shared default
    constraints = [key for key in GRAMMAR_KEYS if obj.get(key) is not None]
    if len(constraints) > 1:
        raise LineError("invalid_value", f"{' and '.join(constraints)} cannot be used together: pick one")
    for key, (attr, check) in fields.items():
        if key in obj:
            changes[attr] = check(key, obj[key])
    try:
        params = dataclasses.replace(defaults, **changes, client="batch", priority="batch")  # checks the ranges
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
        raise LineError("invalid_value", f"method must be POST, got {preview(method, 40)}")
    url = obj.get("url")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise LineError("invalid_value", f"url must be {CHAT_URL} or {COMPLETIONS_URL}, got {preview(url)}")
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


def _line_id(obj: dict, shape: str) -> str | None:
    """The line's own id; None when it has none."""
    key = "custom_id" if shape == OPENAI else "id"
    value = obj.get(key)
    if value is None:
        return None
    if is_int64(value):
        return str(value)
    if isinstance(value, str) and value:
        dump_line(value)  # an id with a lone surrogate could never be written: the line gets line-N
        return value
    raise wrong_type(key, "a non-empty string", value)


def _load_object(raw: bytes) -> dict:
    obj = load_line(raw)
    if not isinstance(obj, dict):
        raise LineError("invalid_type", f"line must be a JSON object, got {type(obj).__name__}")
    return obj


def _check_writable(obj: dict) -> None:
    """What we read must be writable again (it may end up in an error or a result line)."""
    try:
        dump_line(obj)
    except UnicodeEncodeError:
        raise  # a lone surrogate: line_error names it
    except ValueError:
        raise LineError("invalid_json", "line has a number too large for a float (such as 1e400)") from None


def parse_line(raw: bytes, line_no: int, defaults: LineDefaults, file_shape: str = NATIVE,
               claimed: frozenset[str] = frozenset()) -> Job | BadLine:
    """One input line (without its newline) -> a Job, or a BadLine saying what is wrong. Never raises:
    whatever goes wrong with this line, at any step, is this line's error."""
    shape, job_id = file_shape, None
    try:
        obj = _load_object(raw)
        shape = shape_of(obj)
        job_id = _line_id(obj, shape)
        _check_writable(obj)
        build = _openai_job if shape == OPENAI else _native_job
        return build(obj, job_id or auto_id(line_no, claimed), line_no, defaults)
    except Exception as e:  # noqa: BLE001 - one line must never stop the file
        error = line_error(e, "invalid_line")
        return BadLine(job_id or auto_id(line_no, claimed), line_no, shape, error.code, error.message)


def check_input(path: Path) -> None:
    """Refuse, before the model loads, an input that can't be read (missing, a folder, no permission)."""
    with io_errors("read", path), open(path, "rb") as f:
        f.read(1)


def _numbered_lines(path: Path) -> Iterator[tuple[int, bytes, bool]]:
    """(1-based line number, line without its end, whether it is unfinished) for each non-blank
    line, streamed. Unfinished: the last line, with no newline and not whole JSON (see above)."""
    with io_errors("read", path), open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            ended = raw.endswith(b"\n")
            raw = raw.rstrip(b"\r\n")
            if line_no == 1 and raw.startswith(UTF8_BOM):  # some editors start a file with one
                raw = raw[len(UTF8_BOM):]
            if raw.strip():
                yield line_no, raw, not ended and not _whole_json(raw)


def _whole_json(raw: bytes) -> bool:
    try:
        load_line(raw)
    except Exception:  # noqa: BLE001 - whatever stops it parsing: not whole yet
        return False
    return True


@dataclass(frozen=True)
class InputScan:
    """One cheap pass over the input before the run."""

    num_lines: int  # non-blank lines, an unfinished last one left out: the progress bar's total
    shape: str  # of the first line that parses: the shape of error lines for unparsable ones
    claimed: frozenset[str]  # users' own ids that look automatic ("line-..."), which auto ids avoid


def _own_id(raw: bytes) -> tuple[str | None, str | None]:
    """(shape, own id) of a line, or Nones where it has none or doesn't parse."""
    try:
        obj = _load_object(raw)
        shape = shape_of(obj)
        return shape, _line_id(obj, shape)
    except Exception:  # noqa: BLE001 - a bad line is reported when it is read for real
        return None, None


def scan_input(path: Path) -> InputScan:
    num_lines, shape, claimed = 0, None, set()
    for _, raw, unfinished in _numbered_lines(path):
        if unfinished:
            continue
        num_lines += 1
        if shape is None or AUTO_PREFIX.encode() in raw or b"\\u" in raw:  # only these lines can claim
            line_shape, own = _own_id(raw)
            shape = shape or line_shape
            if own is not None and own.startswith(AUTO_PREFIX):
                claimed.add(own)
    return InputScan(num_lines, shape or NATIVE, frozenset(claimed))


def count_lines(path: Path) -> int:
    return scan_input(path).num_lines


def detect_shape(path: Path) -> str:
    return scan_input(path).shape


def read_jobs(path: Path, defaults: LineDefaults,
              scan: InputScan | None = None) -> Iterator[Job | BadLine | UnfinishedLine]:
    """Every non-blank line of `path` in order; a repeated id becomes a BadLine (the first runs), a
    half-written last line an UnfinishedLine."""
    scan = scan or scan_input(path)
    first_line: dict[str, int] = {}
    for line_no, raw, unfinished in _numbered_lines(path):
        if unfinished:
            yield UnfinishedLine(line_no)
            continue
        item = parse_line(raw, line_no, defaults, scan.shape, scan.claimed)
        if item.id in first_line:
            yield BadLine(item.id, line_no, item.shape, "duplicate_id",
                          f"id {item.id!r} already used on line {first_line[item.id]}")
            continue
        first_line[item.id] = line_no
        yield item
