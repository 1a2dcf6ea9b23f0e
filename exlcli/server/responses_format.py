"""Response objects of the Responses API (plain dicts, ready for JSON): the Response, its output
items (reasoning, message, function_call) and its usage, and one request's turn, which knows the
conversation so far and what to store of it once answered."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from exlcli.client.base import GenerationParams, Usage
from exlcli.server.openai_format import ChoiceResult
from exlcli.server.responses_conversation import Conversation
from exlcli.server.responses_request import ResponsesRequest
from exlcli.server.tool_calls import AssistantToolCall, CalledFunction, ToolPlan
from exlcli.text.tool_formats import ToolCall


def new_id(prefix: str) -> str:
    """OpenAI's style for Responses ids: resp_..., msg_..., fc_..., rs_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- output items -----------------------------------------------------------------------------

def output_text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [output_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def function_call_item(item_id: str, call: ToolCall, status: str = "completed", arguments: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def output_items(result: ChoiceResult, plan: ToolPlan) -> tuple[list[dict], str, list[ToolCall]]:
    """A whole answer as output items, with its text (calls taken out) and its calls."""
    items = []
    reasoning = result.reasoning or ""
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning, "completed"))
    content, calls = result.text, []
    if plan.active:
        parsed = plan.parse(result.text)
        if parsed.calls:
            content, calls = parsed.content or "", parsed.calls
    if content or not calls:
        items.append(message_item(new_id("msg"), content, item_status(result.finish_reason)))
    items.extend(function_call_item(new_id("fc"), c) for c in calls)
    return items, content, calls


def item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason in ("length", "cancelled") else "completed"


def usage_object(usage: Usage | None) -> dict:
    u = usage or Usage()
    return {
        "input_tokens": u.prompt_tokens,
        # cache_write_tokens counts explicit cache writes, which exlcli has none of
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def finish_status(finish_reason: str | None) -> tuple[str, dict | None]:
    """The Response's status and incomplete_details for the engine's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "cancelled":
        return "cancelled", None
    return "completed", None


# ---- one request's turn -----------------------------------------------------------------------

@dataclass
class Turn:
    """A request being answered: what its Response echoes, and the conversation it continues."""

    response_id: str
    model: str
    body: ResponsesRequest
    plan: ToolPlan
    params: GenerationParams
    conversation: Conversation  # earlier turns and this input, without instructions
    session: str | None  # the engine's session of the conversation
    owner: str
    created_at: int = 0

    def __post_init__(self) -> None:
        self.created_at = self.created_at or int(time.time())

    def response(self, status: str, output: list[dict], usage: Usage | None = None, error: dict | None = None,
                 incomplete: dict | None = None) -> dict:
        body = self.body
        done = status not in ("in_progress", "queued")
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status, "error": error, "incomplete_details": incomplete,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": body.storing,
            "temperature": self.params.temperature, "top_p": self.params.top_p,
            "text": {"format": (body.text.format if body.text is not None else None) or {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": [t for t in body.tools or [] if t.get("type") == "function"],
            "truncation": "disabled", "user": body.user, "metadata": body.metadata or {},
            "usage": usage_object(usage) if done and error is None else None,
        }

    def history_after(self, content: str, calls: list[ToolCall]) -> list[dict]:
        """The conversation with this turn's answer, as the next turn's template renders it."""
        after = Conversation.of(self.conversation.messages)
        if content or not calls:
            after.messages.append({"role": "assistant", "content": content})
        if calls:
            after.add_calls([AssistantToolCall(id=c.id, function=CalledFunction(name=c.name, arguments=c.arguments))
                             for c in calls])
        return after.messages


def error_object(message: str) -> dict[str, Any]:
    return {"code": "server_error", "message": message}
