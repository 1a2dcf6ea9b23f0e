"""OpenAI tools on chat completions: the request fields (`tools`, `tool_choice`, tool calls and
results in the history), the plan for one request (what the template is told, which grammar
forces a call), and the answer read back as `tool_calls`, whole or streamed.

`tool_choice`: "none" (no tools in the prompt, nothing parsed), "auto" (tools in the prompt, calls
parsed out of the answer), "required" (the grammar forces one or more calls to any tool) or
{"type": "function", "function": {"name": ...}} (the grammar forces one call to that tool).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from exlcli.client.base import GenerationParams
from exlcli.engine.request import GrammarSpec
from exlcli.text.tool_formats import ParsedAnswer, ToolCall, ToolFormat

MAX_TOOLS = 128
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class FunctionDef(_Body):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema_compiles(cls, value: dict | None) -> dict | None:
        if value is None:
            return None
        if value.get("type", "object") != "object":
            raise ValueError("must be a JSON Schema of type \"object\" (a function's named arguments)")
        return value  # whether it compiles is checked off the event loop (grammar_workers.py)


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class AssistantToolCall(_Body):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction

    def text_bytes(self) -> int:
        """UTF-8 size of what the chat template writes of this call."""
        return _utf8_len(self.id) + _utf8_len(self.function.name) + _utf8_len(self.function.arguments)


def _utf8_len(text: str | None) -> int:
    return len(text.encode("utf-8", "replace")) if text else 0


def tools_bytes(tools: list[ToolDef] | None) -> int:
    """UTF-8 size of the tools as the template describes them (name, description, parameter schema)."""
    total = 0
    for tool in tools or []:
        f = tool.function
        total += _utf8_len(f.name) + _utf8_len(f.description)
        if f.parameters is not None:
            total += len(json.dumps(f.parameters, ensure_ascii=False).encode("utf-8", "replace"))
    return total


def tool_dicts(tools: list[ToolDef] | None) -> list[dict] | None:
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def check_tool_choice(tools: list[ToolDef] | None, choice: ToolChoice | None,
                      response_format: dict | None) -> str | None:
    """What is wrong with `tool_choice` beside the other fields (None: nothing)."""
    names = [t.function.name for t in tools or []]
    if len(set(names)) != len(names):
        return "tools: function names must be unique"
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if forced and not names:
        return "tool_choice: forcing a tool call needs \"tools\""
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        return f"tool_choice: the function {choice.function.name!r} is not among the tools"
    if forced and response_format and response_format.get("type") != "text":
        return "tool_choice: a forced tool call cannot be combined with response_format"
    return None


@dataclass
class ToolPlan:
    """What one chat request does with its tools."""

    tools: list[dict] = field(default_factory=list)  # described to the model (none: not parsed)
    forced: str | None = None  # the function a named tool_choice forces
    required: bool = False  # the grammar forces a call
    parallel: bool = True
    format: ToolFormat | None = None

    @classmethod
    def for_request(cls, tools: list[ToolDef] | None, choice: ToolChoice | None, parallel: bool | None,
                    tool_format: ToolFormat) -> "ToolPlan":
        if not tools or choice == "none":
            return cls()
        forced = choice.function.name if isinstance(choice, NamedToolChoice) else None
        dicts = tool_dicts(tools) or []
        return cls(dicts, forced, choice == "required" or forced is not None, parallel is not False,
                   tool_format.know_tools(dicts))

    @property
    def active(self) -> bool:
        return bool(self.tools)

    @property
    def tool_names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def apply(self, params: GenerationParams) -> GenerationParams:
        """The request's parameters with the tools for the template and the forcing grammar."""
        if not self.active:
            return params
        params.tools = self.tools
        if self.required and self.format is not None:
            params.grammar = GrammarSpec("grammar", self.format.grammar(self.tools, self.forced, self.parallel))
        return params

    def parse(self, text: str) -> ParsedAnswer:
        assert self.format is not None
        return self.format.parse(text, self.tool_names)


def finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def tool_call_dicts(calls: list[ToolCall]) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def rewrite_completion(body: dict, plan: ToolPlan) -> dict:
    """A whole chat.completion with each choice's calls moved out of its text into `tool_calls`."""
    if not plan.active:
        return body
    for choice in body["choices"]:
        message = choice["message"]
        parsed = plan.parse(message["content"] or "")
        if parsed.calls:
            message["content"] = parsed.content
            message["tool_calls"] = tool_call_dicts(parsed.calls)
            choice["finish_reason"] = finish_reason(choice["finish_reason"], parsed.calls)
    return body


class ToolCallStream:
    """One streamed choice: content passes through as it comes until it may be a call; each call
    is sent as `tool_calls` deltas (its index, id, name and empty arguments, then the arguments),
    as OpenAI streams them, as soon as its block closes (formats with a closing tag: hermes,
    qwen3_coder, glm45), else at the end of the answer."""

    def __init__(self, plan: ToolPlan) -> None:
        assert plan.format is not None
        self.plan = plan
        self._format = plan.format
        self._text = ""
        self._sent = 0  # characters of _text already sent as content
        self._calls: list[ToolCall] = []  # calls already sent
        self._closed_at = -1  # where the last closing tag read for calls starts

    def ready(self) -> list[dict]:
        """The deltas of calls whose blocks closed since the last look."""
        end_tag = getattr(self._format, "call_end", "")
        last = self._text.rfind(end_tag) if end_tag else -1
        if last <= self._closed_at:
            return []
        self._closed_at = last
        new = self.plan.parse(self._text[:last + len(end_tag)]).calls[len(self._calls):]
        deltas = _call_deltas(new, len(self._calls))
        self._calls += new
        return deltas

    def feed(self, text: str) -> str:
        """Content that can be sent now (a format's content_end only grows, once text is content)."""
        self._text += text
        end = self._format.content_end(self._text)
        if end <= self._sent:
            return ""
        out, self._sent = self._text[self._sent:end], end
        return out

    def finish(self, reason: str | None) -> tuple[list[dict], str | None]:
        """The last deltas (content left, then the calls) and the choice's finish reason."""
        parsed = self.plan.parse(self._text)
        if not parsed.calls:
            rest = self._text[self._sent:]
            return ([{"content": rest}] if rest else []), reason
        deltas: list[dict] = []
        sent = self._text[:self._sent].strip()
        content = parsed.content or ""
        if content.startswith(sent) and content[len(sent):].strip():
            deltas.append({"content": content[len(sent):]})  # text after the calls
        deltas += _call_deltas(parsed.calls[len(self._calls):], len(self._calls))
        return deltas, finish_reason(reason, parsed.calls)


def _call_deltas(calls: list[ToolCall], first_index: int) -> list[dict]:
    deltas: list[dict] = []
    for index, call in enumerate(calls, first_index):
        deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                       "function": {"name": call.name, "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
    return deltas


def history_message(role: str, content: str | None, tool_calls: list[AssistantToolCall] | None,
                    tool_call_id: str | None, name: str | None) -> dict[str, Any]:
    """A chat message as templates take it: tool calls and results kept beside the text."""
    message: dict[str, Any] = {"role": role, "content": content or ""}
    if tool_calls:
        message["tool_calls"] = [c.model_dump() for c in tool_calls]
    if role == "tool":
        message["tool_call_id"] = tool_call_id or ""
        if name:
            message["name"] = name
    return message
