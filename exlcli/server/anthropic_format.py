"""Anthropic's Messages API in exlcli's terms: the request body (checked strictly, a bad field named),
its conversation as the chat template's messages (tool_use blocks become assistant tool calls,
tool_result blocks tool messages), its tools as a ToolPlan, and the answer as a Message.

Content blocks are checked by hand rather than by a pydantic union, so that an error names the
block (`messages.1.content.0.tool_use_id: ...`) instead of every branch the union tried.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from exlcli.client.base import GenerationParams, Usage
from exlcli.engine.sampling import API_PARAMS
from exlcli.server.grammar_workers import GrammarCheck
from exlcli.server.http_errors import APIError
from exlcli.server.openai_format import ChoiceResult
from exlcli.server.schemas import MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOP_STRINGS, ClientLabel, Text
from exlcli.server.tool_calls import MAX_TOOLS, AssistantToolCall, CalledFunction, ToolPlan, history_message
from exlcli.text.tool_formats import ToolCall, ToolFormat

TOOL_NAME = r"^[A-Za-z0-9_-]{1,128}$"  # Anthropic's rule for tool names
# Blocks a text-only model cannot read: their 400 says so.
_MEDIA_BLOCKS = ("image", "document")


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class ToolSpec(_Body):
    name: str = Field(pattern=TOOL_NAME)
    description: Text | None = None
    input_schema: dict
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, bash...) have other types

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, value: dict) -> dict:
        if value.get("type", "object") != "object":
            raise ValueError("must be a JSON Schema of type \"object\" (a tool's named inputs)")
        return value


class ToolChoiceSpec(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with "tool"
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Body):
    # Accepted: a model that thinks does so by its template; its reasoning comes back as thinking
    # blocks wherever the server separates it.
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)


class Metadata(_Body):
    user_id: Text | None = None


class InputMessage(_Body):
    # "system" within the conversation: Claude Code sends one (its beta "mid-conversation-system")
    role: Literal["user", "assistant", "system"]
    content: Text | list[Any]


class _Conversation(_Body):
    """What count_tokens and messages share."""

    model: Text
    messages: list[InputMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Text | list[Any] | None = None
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoiceSpec | None = None
    thinking: ThinkingConfig | None = None


class CountTokensRequest(_Conversation):
    pass


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[Text] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=2**31 - 1)
    metadata: Metadata | None = None
    # exlcli extensions, as on the OpenAI routes: scheduling class and the display's label
    priority: Literal["interactive", "batch"] | None = None
    client: ClientLabel | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _check_stops(cls, value: list[str] | None) -> list[str] | None:
        for s in value or []:
            if not s or len(s) > MAX_STOP_CHARS:
                raise ValueError(f"each stop sequence must have 1 to {MAX_STOP_CHARS} characters")
        return value

    def generation_params(self, context_length: int) -> GenerationParams:
        """The engine's defaults for what the body leaves out. max_tokens is capped at the context
        (agents ask for 32000 whatever the model): the answer then ends at the context's end."""
        values = {p.name: p.default for p in API_PARAMS}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        values["max_tokens"] = min(self.max_tokens, context_length)
        return GenerationParams(**values, stop=list(self.stop_sequences or []),
                                priority=self.priority or "interactive", client=self.client or "api")


# ---- the conversation as the template's messages ------------------------------------------------

def _bad(path: str, message: str) -> APIError:
    return APIError(400, message, param=path)


def _block_type(block: Any, path: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise _bad(path, "each content block must be an object with a \"type\"")
    return block["type"]


def _text_of(block: dict, path: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{path}.text", "a text block needs its \"text\"")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(f"{path}.text", "is not valid Unicode text (it holds a lone surrogate)") from None
    return text


def _unsupported(kind: str, path: str, role: str) -> APIError:
    if kind in _MEDIA_BLOCKS:
        return _bad(f"{path}.type", f"{kind} blocks are not supported: this server's model reads text only")
    allowed = "text, tool_result" if role == "user" else "text, tool_use, thinking"
    return _bad(f"{path}.type", f"content block type {kind!r} is not supported in a {role} message "
                                f"(this server takes {allowed} blocks)")


def system_text(system: str | list | None, path: str = "system") -> str:
    """A system prompt as one text: a string, or text blocks joined by blank lines."""
    if system is None or isinstance(system, str):
        return system or ""
    texts = []
    for j, block in enumerate(system):
        block_path = f"{path}.{j}"
        kind = _block_type(block, block_path)
        if kind != "text":
            raise _bad(f"{block_path}.type", f"a system prompt takes text blocks only, not {kind!r}")
        texts.append(_text_of(block, block_path))
    return "\n\n".join(t for t in texts if t)


def _tool_result_text(block: dict, path: str) -> str:
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        parts = []
        for k, inner in enumerate(content):
            inner_path = f"{path}.content.{k}"
            kind = _block_type(inner, inner_path)
            if kind != "text":
                raise (_unsupported(kind, inner_path, "user") if kind in _MEDIA_BLOCKS else
                       _bad(f"{inner_path}.type", f"a tool result holds text blocks only, not {kind!r}"))
            parts.append(_text_of(inner, inner_path))
        text = "\n".join(parts)
    else:
        raise _bad(f"{path}.content", "must be a text or a list of text blocks")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise _bad(f"{path}.is_error", "must be true or false")
    return f"Error: {text}" if is_error else text  # the model reads that the tool failed


def _user_turn(blocks: list, path: str, called: dict[str, str]) -> list[dict]:
    """A user message: its tool results as tool messages (first, where templates expect them,
    right after the calls), then its text as one user message."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        block_path = f"{path}.{j}"
        kind = _block_type(block, block_path)
        if kind == "text":
            texts.append(_text_of(block, block_path))
        elif kind == "tool_result":
            use_id = block.get("tool_use_id")
            if not isinstance(use_id, str) or not use_id:
                raise _bad(f"{block_path}.tool_use_id", "a tool_result needs the id of the tool_use it answers")
            if use_id not in called:
                raise _bad(f"{block_path}.tool_use_id", f"no earlier tool_use block has the id {use_id!r}")
            text = _tool_result_text(block, block_path)
            results.append(history_message("tool", text, None, use_id, called[use_id]))
        else:
            raise _unsupported(kind, block_path, "user")
    if texts or not results:
        results.append(history_message("user", "\n\n".join(texts), None, None, None))
    return results


def _assistant_turn(blocks: list, path: str, called: dict[str, str]) -> dict:
    texts, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        block_path = f"{path}.{j}"
        kind = _block_type(block, block_path)
        if kind == "text":
            texts.append(_text_of(block, block_path))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise _bad(f"{block_path}.thinking", "a thinking block needs its \"thinking\" text")
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # another server's encrypted reasoning: nothing this model can read
        elif kind == "tool_use":
            use_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(use_id, str) or not 1 <= len(use_id) <= 256:
                raise _bad(f"{block_path}.id", "a tool_use needs an id of 1 to 256 characters")
            if not isinstance(name, str) or not name:
                raise _bad(f"{block_path}.name", "a tool_use needs the tool's name")
            if not isinstance(arguments, dict):
                raise _bad(f"{block_path}.input", "must be an object (the tool's inputs)")
            called[use_id] = name
            calls.append(AssistantToolCall(id=use_id, function=CalledFunction(
                name=name, arguments=json.dumps(arguments, ensure_ascii=False))))
        else:
            raise _unsupported(kind, block_path, "assistant")
    message = history_message("assistant", "".join(texts), calls or None, None, None)
    if thinking:
        message["reasoning_content"] = "\n\n".join(thinking)  # where a template shows past reasoning
    return message


def chat_messages(body: _Conversation) -> list[dict]:
    """The conversation as the chat template takes it (a 400 naming the block that cannot be)."""
    out: list[dict] = []
    system = system_text(body.system)
    if system:
        out.append({"role": "system", "content": system})
    called: dict[str, str] = {}  # tool_use id -> tool name, for the results that answer them
    for i, m in enumerate(body.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        path = f"messages.{i}.content"
        if m.role == "system":  # where it stands: templates that take system turns anywhere render it there
            out.append({"role": "system", "content": system_text(m.content, path)})
        elif m.role == "user":
            out.extend(_user_turn(blocks, path, called))
        else:
            out.append(_assistant_turn(blocks, path, called))
    return out


def _utf8(text: Any) -> int:
    return len(text.encode("utf-8", "replace")) if isinstance(text, str) else 0


def prompt_parts(messages: list[dict], plan: ToolPlan) -> dict[str, int]:
    """UTF-8 size of what reaches the template, by field (ServerState.check_prompt_size)."""
    system = sum(_utf8(m["content"]) for m in messages if m["role"] == "system")
    rest = 0
    for m in messages:
        if m["role"] != "system":
            rest += _utf8(m.get("content")) + _utf8(m.get("reasoning_content")) + _utf8(m.get("tool_call_id"))
            rest += sum(_utf8(c["id"]) + _utf8(c["function"]["name"]) + _utf8(c["function"]["arguments"])
                        for c in m.get("tool_calls") or [])
    tools = sum(_utf8(json.dumps(t, ensure_ascii=False)) for t in plan.tools)
    return {"system": system, "messages": rest, "tools": tools}


# ---- tools --------------------------------------------------------------------------------------

def tool_plan(body: _Conversation, tool_format: ToolFormat) -> ToolPlan:
    """`tools` and `tool_choice` as the plan the OpenAI routes use: auto parses calls out of the
    answer, any forces a call to some tool, tool forces one to the named tool, none leaves the
    tools out of the prompt."""
    tools, choice = body.tools or [], body.tool_choice
    names = [t.name for t in tools]
    for i, t in enumerate(tools):
        if t.type is not None and t.type != "custom":
            raise _bad(f"tools.{i}.type", f"server tool {t.type!r} is not supported (tools with an "
                                          "input_schema are)")
        if names.index(t.name) != i:
            raise _bad(f"tools.{i}.name", f"tool names must be unique ({t.name!r} comes twice)")
    kind = choice.type if choice else "auto"
    if kind in ("any", "tool") and not tools:
        raise _bad("tool_choice", f"tool_choice {kind!r} needs \"tools\"")
    if kind == "tool":
        if not choice or not choice.name:
            raise _bad("tool_choice.name", "tool_choice \"tool\" needs the tool's name")
        if choice.name not in names:
            raise _bad("tool_choice.name", f"the tool {choice.name!r} is not among the tools")
    if not tools or kind == "none":
        return ToolPlan()
    dicts = [{"type": "function", "function": {"name": t.name, **({"description": t.description}
                                                                    if t.description else {}),
                                               "parameters": t.input_schema}} for t in tools]
    forced = choice.name if choice and kind == "tool" else None
    parallel = not (choice and choice.disable_parallel_tool_use)
    return ToolPlan(dicts, forced, kind in ("any", "tool"), parallel, tool_format)


def grammar_checks(plan: ToolPlan) -> list[GrammarCheck]:
    """The schemas a forcing grammar will embed, checked before it is built. Under auto nothing
    compiles a schema, so an agent's tool whose schema the grammar engine cannot take still works."""
    if not plan.required:
        return []
    return [GrammarCheck(f"tools.{i}.input_schema", "json_schema", t["function"]["parameters"])
            for i, t in enumerate(plan.tools) if plan.forced in (None, t["function"]["name"])]


# ---- reasoning: the one place that reads it ----------------------------------------------------

def collected_reasoning(result: ChoiceResult) -> str | None:
    """The reasoning of a whole answer, where the server separates it from the answer's text
    (`result.reasoning`); else none, and the answer's text is all of it."""
    return getattr(result, "reasoning", None) or None


class AnswerOnly:
    """A streamed answer split into ("thinking" | "text", piece) parts. Until the server separates
    reasoning, every piece is text."""

    def feed(self, text: str) -> list[tuple[str, str]]:
        return [("text", text)] if text else []

    def finish(self) -> list[tuple[str, str]]:
        return []


def reasoning_splitter() -> AnswerOnly:
    return AnswerOnly()


# ---- the answer ---------------------------------------------------------------------------------

def stop_reason(finish_reason: str | None, stop_string: str | None, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for an engine finish reason. A cancelled or failed generation
    has none (the caller answers with an error)."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def unfinished_error(finish_reason: str | None) -> APIError | None:
    """The error for a generation that did not end by itself (None: it did)."""
    if finish_reason == "cancelled":
        return APIError(500, "the generation was cancelled (the server's --request-timeout, or a cancel request)",
                        "server_error")
    return None


def usage_body(usage: Usage | None) -> dict:
    """Anthropic counts prompt tokens served from the cache apart from the rest."""
    usage = usage or Usage()
    return {"input_tokens": max(usage.prompt_tokens - usage.cached_tokens, 0),
            "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens}


def tool_use_block(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)}


def message_body(message_id: str, model: str, result: ChoiceResult, plan: ToolPlan) -> dict:
    content: list[dict] = []
    reasoning = collected_reasoning(result)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text, calls = result.text, []
    if plan.active:
        parsed = plan.parse(text)
        if parsed.calls:
            text, calls = parsed.content or "", parsed.calls
    if text:
        content.append({"type": "text", "text": text})
    content.extend(tool_use_block(c) for c in calls)
    reason, sequence = stop_reason(result.finish_reason, result.stop_string, bool(calls))
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage_body(result.usage)}
