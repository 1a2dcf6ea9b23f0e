"""The body of POST /v1/responses (OpenAI's Responses API), validated strictly so that a bad field
becomes a 400 naming it.

Input items: messages (text content parts: `input_text`, and `output_text` of an earlier answer),
`function_call` and `function_call_output`, and `reasoning` items (accepted, not rendered: chat
templates drop an earlier turn's reasoning); responses_conversation.py makes them chat messages.
Tools: function tools in the Responses shape (`{"type": "function", "name", "parameters"}`);
hosted tools (web_search, file_search, namespaces, custom tools ...) are accepted and not offered
to the model, which cannot run them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from exlcli.client.base import GenerationParams
from exlcli.engine.sampling import API_PARAMS, MAX_TOKENS
from exlcli.server.schemas import (
    MAX_MESSAGES,
    ClientLabel,
    ParamError,
    Text,
    _api_field,
    _Body,
    _GenerationFields,
    _grammar_spec,
    _valid_unicode,
)
from exlcli.server.tool_calls import (
    FUNCTION_NAME,
    MAX_TOOLS,
    FunctionDef,
    FunctionName,
    NamedToolChoice,
    ToolChoice,
    ToolDef,
    check_tool_choice,
    tools_bytes,
)

MAX_METADATA_KEYS = 16  # OpenAI's limits on `metadata`
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
TEXT_PARTS = ("input_text", "output_text", "text")  # what a message's content may hold
ROLES = ("user", "system", "developer", "assistant")


def _error_param(prefix: str, e: ValidationError) -> ParamError:
    first = e.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    return ParamError(f"{prefix}.{loc}" if loc else prefix, first.get("msg", "invalid").removeprefix("Value error, "))


def parts_text(value: str | list, param: str, kinds: tuple[str, ...] = TEXT_PARTS) -> str:
    """A content list's text parts joined (as chat's content parts are); any other part is a 400."""
    if isinstance(value, str):
        return value
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):  # an earlier answer's refusal
            texts.append(_valid_unicode(part["refusal"]))
            continue
        if kind not in kinds:
            raise ParamError(f"{param}.{j}.type", f"content part type {kind!r} is not supported; this server "
                                                  f"takes text parts ({', '.join(kinds)})")
        if not isinstance(part.get("text"), str):
            raise ParamError(f"{param}.{j}.text", "must be a string")
        texts.append(_valid_unicode(part["text"]))
    return "".join(texts)


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[Any]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: Text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: Text | list[Any]
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_TYPES: dict[str, type[BaseModel]] = {
    "message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem}


def parse_item(index: int, raw: Any) -> InputItem:
    param = f"input.{index}"
    if not isinstance(raw, dict):
        raise ParamError(param, "must be an object (an input item)")
    kind = raw.get("type", "message" if "role" in raw else None)
    model = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ParamError(f"{param}.type", f"unknown input item type {kind!r}; this server takes "
                                          f"{', '.join(ITEM_TYPES)} items")
    try:
        item = model.model_validate(raw)
    except ValidationError as e:
        raise _error_param(param, e) from None
    if isinstance(item, MessageItem):
        parts_text(item.content, f"{param}.content")
    if isinstance(item, FunctionCallOutputItem):
        parts_text(item.output, f"{param}.output", ("input_text", "text"))
    return item  # type: ignore[return-value]


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)


class TextFormat(_Body):
    format: dict | None = None
    verbosity: str | None = None


class ResponsesRequest(_GenerationFields):
    """POST /v1/responses. Sampling fields (temperature, top_p and exlcli's top_k, min_p, seed ...)
    as in chat; None means the default."""

    model: Text | None = None
    input: Text | list[Any]
    instructions: Text | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=200)
    tools: list[Any] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = _api_field(MAX_TOKENS)
    text: TextFormat | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    stream: bool | None = None
    reasoning: dict | None = None  # effort / summary: accepted; how much a model thinks is its own
    include: list[str] | None = None
    user: Text | None = None
    # the cache key of a conversation sent whole each turn (Codex): it names the engine's session
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=200)
    background: bool | None = None
    conversation: Any = None
    truncation: Literal["auto", "disabled"] | None = None
    # exlcli extensions, as in chat
    priority: Literal["interactive", "batch"] | None = None
    client: ClientLabel | None = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: str | list) -> str | list:
        if isinstance(value, list):
            if not value or len(value) > MAX_MESSAGES:
                raise ValueError(f"a list input must hold 1 to {MAX_MESSAGES} items")
            return [parse_item(i, raw) for i, raw in enumerate(value)]
        return value

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: list | None) -> list | None:
        for i, tool in enumerate(value or []):
            if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
                raise ParamError(f"tools.{i}.type", "each tool needs a \"type\"")
            if tool["type"] == "function":
                fields = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
                try:
                    FunctionDef.model_validate(fields)
                except ValidationError as e:
                    raise _error_param(f"tools.{i}", e) from None
        return value

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, value: str | dict | None) -> str | dict | None:
        if isinstance(value, dict):
            if value.get("type") != "function":
                raise ParamError("tool_choice", f"tool_choice type {value.get('type')!r} is not supported; use "
                                                "\"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                                                "\"name\": ...}")
            try:
                FunctionChoice.model_validate(value)
            except ValidationError as e:
                raise _error_param("tool_choice", e) from None
        return value

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} keys are allowed")
        for k, v in value.items():
            if len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"keys may have at most {MAX_METADATA_KEY_CHARS} characters and values "
                                 f"{MAX_METADATA_VALUE_CHARS}")
        return value

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background responses are not supported by this server")
        return value

    @field_validator("conversation")
    @classmethod
    def _no_conversation(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("conversations are not supported by this server; use previous_response_id")
        return None

    @model_validator(mode="after")
    def _fields_fit(self) -> "ResponsesRequest":
        if self.text is not None:
            try:
                _grammar_spec(self.response_format)
            except ValueError as e:
                raise ParamError("text.format", str(e).replace("response_format", "text.format")) from None
        problem = check_tool_choice(self.tool_defs(), self.chat_tool_choice(), self.response_format)
        if problem:
            param, _, message = problem.partition(": ")
            raise ParamError(param, message.replace("response_format", "text.format"))
        return self

    # ---- read as chat ---------------------------------------------------------------------------

    @property
    def response_format(self) -> dict | None:
        """`text.format` as chat's response_format (structured output)."""
        fmt = self.text.format if self.text is not None else None
        if not fmt or fmt.get("type") != "json_schema":
            return fmt
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}

    def tool_defs(self) -> list[ToolDef]:
        """The function tools, in chat's nested shape (hosted tool types are left out)."""
        defs = []
        for tool in self.tools or []:
            if tool.get("type") == "function":
                fields = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
                defs.append(ToolDef(type="function", function=FunctionDef.model_validate(fields)))
        return defs

    def chat_tool_choice(self) -> ToolChoice | None:
        if isinstance(self.tool_choice, dict):
            return NamedToolChoice(type="function", function=FunctionName(name=self.tool_choice["name"]))
        return self.tool_choice

    def items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    # ---- what ServerState.check reads --------------------------------------------------------------

    @property
    def max_tokens_param(self) -> str:
        return "max_output_tokens" if self.max_output_tokens is not None else "max_tokens"

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def storing(self) -> bool:
        return self.store is not False

    def prompt_parts(self) -> dict[str, int]:
        """UTF-8 size of what reaches the template, by field (the previous turns are added once known)."""
        return {"input": sum(item_bytes(i) for i in self.items()),
                "instructions": len((self.instructions or "").encode()), "tools": tools_bytes(self.tool_defs())}

    def generation_params(self, index: int, default_max_tokens: int) -> GenerationParams:
        values = {p.name: p.default if getattr(self, p.name) is None else getattr(self, p.name) for p in API_PARAMS}
        asked = self.max_output_tokens if self.max_output_tokens is not None else self.max_tokens
        values.update(max_tokens=asked if asked is not None else default_max_tokens)
        return GenerationParams(**values, priority=self.priority or "interactive", client=self.client or "api",
                                grammar=_grammar_spec(self.response_format))


def item_bytes(item: InputItem) -> int:
    if isinstance(item, MessageItem):
        return len(parts_text(item.content, "").encode())
    if isinstance(item, FunctionCallItem):
        return len(item.call_id.encode()) + len(item.name.encode()) + len(item.arguments.encode())
    if isinstance(item, FunctionCallOutputItem):
        return len(item.call_id.encode()) + len(parts_text(item.output, "").encode())
    return 0
