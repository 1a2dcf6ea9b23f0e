"""What a client hands the engine, and what it gets back."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

from exlcli.engine.sampling import MAX_TOKENS, SamplingParams
from exlcli.errors import RequestError


class Priority(enum.IntEnum):
    """Lower value is served first."""

    INTERACTIVE = 0
    BATCH = 1

    @classmethod
    def parse(cls, value: "str | int | Priority") -> "Priority":
        if isinstance(value, Priority):
            return value
        if isinstance(value, int):
            return cls(value)
        try:
            return cls[str(value).upper()]
        except KeyError:
            raise RequestError(
                f"unknown priority {value!r}; use 'interactive' or 'batch'") from None


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """What the generated text must match. `value`: the JSON Schema (a dict, or its JSON text) for
    json_schema, the regex for regex, the EBNF (GBNF) grammar for grammar, None for json_object (any
    JSON object). `strict` (json_schema): properties and items the schema does not name are not
    generated (OpenAI's strict mode); else the schema is read as written (extra properties allowed
    unless additionalProperties says otherwise)."""

    kind: str
    value: str | dict | None = None
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise RequestError(f"unknown constraint kind {self.kind!r}; use one of {', '.join(GRAMMAR_KINDS)}")
        if self.kind == "json_object":
            return
        if self.kind == "json_schema" and not isinstance(self.value, (dict, str, bool)):
            raise RequestError("a json_schema constraint needs the schema (a JSON object)")
        if self.kind != "json_schema" and (not isinstance(self.value, str) or not self.value):
            raise RequestError(f"a {self.kind} constraint needs a non-empty string")


def grammar_from_response_format(response_format: Any) -> "GrammarSpec | None":
    """OpenAI's response_format as a GrammarSpec: {"type": "text"}, {"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}}, and
    exlcli's {"type": "regex", "regex": ...} and {"type": "grammar", "grammar": ...} (Lark or GBNF).
    Whether the schema compiles is checked when the request is submitted."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise RequestError("response_format must be an object such as {\"type\": \"json_object\"}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind in ("regex", "grammar"):  # exlcli extensions: {"type": "regex", "regex": "..."}, likewise grammar
        value = response_format.get(kind)
        if not isinstance(value, str) or not value:
            raise RequestError(f"response_format {kind} needs {{\"{kind}\": a non-empty string}}")
        return GrammarSpec(kind, value)
    if kind != "json_schema":
        raise RequestError(f"response_format type must be text, json_object or json_schema (or exlcli's regex or "
                           f"grammar), got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
        raise RequestError("response_format json_schema needs {\"name\": ..., \"schema\": {a JSON Schema}}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError("response_format json_schema strict must be true or false")
    return GrammarSpec("json_schema", spec["schema"], strict=bool(strict))


def response_format_of(spec: "GrammarSpec | None") -> dict | None:
    """The response_format that grammar_from_response_format reads back as `spec`."""
    if spec is None:
        return None
    if spec.kind == "json_object":
        return {"type": "json_object"}
    if spec.kind == "json_schema":
        schema = json.loads(spec.value) if isinstance(spec.value, str) else spec.value
        return {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema, "strict": spec.strict}}
    return {"type": spec.kind, spec.kind: spec.value}


@dataclass
class Request:
    """One generation. `prompt_ids` are already tokenised (chat template applied)."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = MAX_TOKENS.default
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    priority: Priority = Priority.INTERACTIVE
    ignore_eos: bool = False
    client: str = "api"  # who asked: chat / batch / bench / api; shown on the live display
    grammar: GrammarSpec | None = None  # structured output: the text must match it
    speculative: bool | None = None  # False: never draft for this request; None/True: the engine's choice
    # Past the window (engine/context_window.py): "stop", "shift" or "sinks"; None: the engine's default
    context_overflow: str | None = None
    sink_tokens: int | None = None  # kept at the start (None: the engine's, 4)
    window: int | None = None  # most tokens in the cache (None: the engine's, its context)
    # A continuation (engine/sessions.py): keep the cache after the request ends under this name, and
    # resume the one kept under it when the prompt starts with its tokens
    session: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise RequestError("the prompt is empty")
        MAX_TOKENS.check(self.max_new_tokens, "max_new_tokens")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("every stop string must be a non-empty string")
        self.sampling.validate()
        if self.session is not None and (not isinstance(self.session, str) or not self.session):
            raise RequestError("session must be a non-empty string")


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    generated_tokens: int = 0
    queue_time: float = 0.0  # seconds from submit to first scheduled
    ttft: float | None = None  # seconds from submit to first generated token
    total_time: float = 0.0  # seconds from submit to finish
    num_preemptions: int = 0
    evicted_tokens: int = 0  # tokens that left the cache by context shifts (context_overflow shift / sinks)

    @property
    def decode_tps(self) -> float:
        """Generated tokens per second after the first one."""
        if self.ttft is None or self.generated_tokens < 2:
            return 0.0
        span = self.total_time - self.ttft
        return (self.generated_tokens - 1) / span if span > 0 else 0.0


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    """A delta: what is new for one request since the last output."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    stats: RequestStats | None = None  # set on the final output
    stop_string: str | None = None  # on the final output: the stop string that ended the text, if one did

    def absorb(self, later: RequestOutput) -> None:
        """Take in the delta that follows this one (this one unfinished): one delta of both."""
        self.new_token_ids.extend(later.new_token_ids)
        self.new_text += later.new_text
        if later.logprobs:  # (extended in place: a late reader's delta grows a token at a time)
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(later.logprobs)
        self.finished, self.finish_reason, self.error, self.stats = (later.finished, later.finish_reason,
                                                                     later.error, later.stats)
        self.stop_string = later.stop_string
