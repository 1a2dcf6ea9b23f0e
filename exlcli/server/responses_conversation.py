"""A Responses conversation as the chat messages a template renders: input items added one by
one (a function call joins the assistant message before it; a function call's output must answer
a call made earlier in the conversation), and the prompt's system message first."""

from __future__ import annotations

from dataclasses import dataclass, field

from exlcli.server.responses_request import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    parts_text,
)
from exlcli.server.schemas import ParamError
from exlcli.server.tool_calls import AssistantToolCall, CalledFunction, history_message


@dataclass
class Conversation:
    """Chat messages as the template takes them, built item by item."""

    messages: list[dict] = field(default_factory=list)
    call_ids: set[str] = field(default_factory=set)  # every function call so far, for their outputs

    @classmethod
    def of(cls, messages: list[dict]) -> "Conversation":
        ids = {c["id"] for m in messages for c in m.get("tool_calls") or []}
        return cls(list(messages), ids)

    def add_items(self, items: list[InputItem]) -> None:
        for i, item in enumerate(items):
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                self.messages.append(history_message(role, parts_text(item.content, ""), None, None, None))
            elif isinstance(item, FunctionCallItem):
                self.add_calls([AssistantToolCall(id=item.call_id, function=CalledFunction(
                    name=item.name, arguments=item.arguments))])
            elif isinstance(item, FunctionCallOutputItem):
                if item.call_id not in self.call_ids:
                    raise ParamError(f"input.{i}.call_id", f"no function call with call_id {item.call_id!r} comes "
                                                           "before this output")
                self.messages.append(history_message("tool", parts_text(item.output, ""), None, item.call_id, None))

    def add_calls(self, calls: list[AssistantToolCall]) -> None:
        """An answer's calls join the assistant message just before them (its text, or other calls)."""
        last = self.messages[-1] if self.messages else None
        dumped = [c.model_dump() for c in calls]
        if last is not None and last["role"] == "assistant":  # a copy: stored histories share their dicts
            self.messages[-1] = {**last, "tool_calls": [*(last.get("tool_calls") or []), *dumped]}
        else:
            self.messages.append(history_message("assistant", None, calls, None, None))
        self.call_ids.update(c.id for c in calls)


def prompt_messages(instructions: str | None, history: list[dict]) -> list[dict]:
    """What the template renders: `instructions` and any system messages that open the history as
    one system message first (many templates take a system message only there), then the rest."""
    lead = [instructions] if instructions else []
    rest = list(history)
    while rest and rest[0]["role"] == "system":
        lead.append(rest.pop(0)["content"])
    return ([{"role": "system", "content": "\n\n".join(lead)}] if lead else []) + rest
