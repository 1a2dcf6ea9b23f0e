"""The server-sent events of a streamed Response, as OpenAI sends them: each event named
(`event: response.output_text.delta`) with its JSON carrying the same `type` and a
`sequence_number` counted from 0, and no `[DONE]` at the end.

The order: response.created and response.in_progress; per output item, output_item.added, then its
content (a message: content_part.added, output_text.delta ..., output_text.done, content_part.done;
a function call: function_call_arguments.delta and .done; reasoning: reasoning_text.delta and
.done), then output_item.done; last, response.completed (or response.incomplete when it ran out of
max_output_tokens, response.failed when the engine failed).
"""

from __future__ import annotations

import json
from typing import AsyncIterator, Callable

from sse_starlette import ServerSentEvent

from exlcli.server.generations import GenerationGroup
from exlcli.server.responses_format import (
    Turn,
    error_object,
    finish_status,
    function_call_item,
    item_status,
    message_item,
    new_id,
    output_text_part,
    reasoning_item,
)
from exlcli.server.sse import SEP
from exlcli.server.tool_calls import ToolCallStream
from exlcli.text.tool_formats import ToolCall

Finished = Callable[[Turn, dict, str, list[ToolCall]], None]  # (turn, response, text, calls): store it


class EventWriter:
    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: object) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return ServerSentEvent(data=json.dumps(payload, separators=(",", ":")), event=kind, sep=SEP).encode()


class _OpenItem:
    """The output item being streamed (a reasoning item or a message) and its text so far."""

    def __init__(self, kind: str, index: int) -> None:
        self.kind, self.index = kind, index
        self.id = new_id("rs" if kind == "reasoning" else "msg")
        self.text = ""


class OutputStream:
    """Turns text as it comes into output items and their events."""

    def __init__(self, emit: EventWriter) -> None:
        self.emit = emit
        self.output: list[dict] = []
        self.open: _OpenItem | None = None

    def text(self, kind: str, text: str) -> list[bytes]:
        """`text` of a reasoning item or the message, opening the item (and closing another) first."""
        events = []
        if self.open is not None and self.open.kind != kind:
            events += self.close("completed")
        if self.open is None:
            events += self._begin(kind)
        item = self.open
        assert item is not None
        if text:
            item.text += text
            if kind == "reasoning":
                events.append(self.emit("response.reasoning_text.delta", item_id=item.id, output_index=item.index,
                                        content_index=0, delta=text))
            else:
                events.append(self.emit("response.output_text.delta", item_id=item.id, output_index=item.index,
                                        content_index=0, delta=text, logprobs=[]))
        return events

    def _begin(self, kind: str) -> list[bytes]:
        item = self.open = _OpenItem(kind, len(self.output))
        if kind == "reasoning":
            return [self.emit("response.output_item.added", output_index=item.index,
                              item=reasoning_item(item.id, None, "in_progress"))]
        return [self.emit("response.output_item.added", output_index=item.index,
                          item=message_item(item.id, None, "in_progress")),
                self.emit("response.content_part.added", item_id=item.id, output_index=item.index, content_index=0,
                          part=output_text_part(""))]

    def close(self, status: str) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        if item.kind == "reasoning":
            done = reasoning_item(item.id, item.text, status)
            events = [self.emit("response.reasoning_text.done", item_id=item.id, output_index=item.index,
                                content_index=0, text=item.text)]
        else:
            done = message_item(item.id, item.text, status)
            events = [self.emit("response.output_text.done", item_id=item.id, output_index=item.index,
                                content_index=0, text=item.text, logprobs=[]),
                      self.emit("response.content_part.done", item_id=item.id, output_index=item.index,
                                content_index=0, part=output_text_part(item.text))]
        self.output.append(done)
        return events + [self.emit("response.output_item.done", output_index=item.index, item=done)]

    def call(self, call: ToolCall) -> list[bytes]:
        events = self.close("completed")
        index, item_id = len(self.output), new_id("fc")
        done = function_call_item(item_id, call)
        events += [
            self.emit("response.output_item.added", output_index=index,
                      item=function_call_item(item_id, call, "in_progress", arguments="")),
            self.emit("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                      delta=call.arguments),
            self.emit("response.function_call_arguments.done", item_id=item_id, output_index=index,
                      arguments=call.arguments),
        ]
        self.output.append(done)
        return events + [self.emit("response.output_item.done", output_index=index, item=done)]


async def response_events(group: GenerationGroup, turn: Turn, finished: Finished) -> AsyncIterator[bytes]:
    emit = EventWriter()
    out = OutputStream(emit)
    yield emit("response.created", response=turn.response("in_progress", []))
    yield emit("response.in_progress", response=turn.response("in_progress", []))
    # with tools, text that may be a call is held back, and the calls are read at the end
    calls = ToolCallStream(turn.plan) if turn.plan.active else None
    content = ""
    async for item in group.deltas():
        d = item.delta
        if d.error:
            for chunk in out.close("incomplete"):
                yield chunk
            yield emit("response.failed", response=turn.response("failed", out.output, error=error_object(d.error)))
            return
        if item.reasoning:
            for chunk in out.text("reasoning", item.reasoning):
                yield chunk
        text = calls.feed(item.content) if calls is not None else item.content
        if text:
            content += text
            for chunk in out.text("message", text):
                yield chunk
        if not d.finished:
            continue
        made: list[ToolCall] = []
        if calls is not None:
            last, _ = calls.finish(d.finish_reason)
            for delta in last:
                if "content" in delta:
                    content += delta["content"]
                    for chunk in out.text("message", delta["content"]):
                        yield chunk
                for tc in delta.get("tool_calls", []):
                    if "id" in tc:
                        made.append(ToolCall(tc["function"]["name"], "", tc["id"]))
                    else:
                        made[tc["index"]].arguments = tc["function"]["arguments"]
        if not made and (out.open is None or out.open.kind != "message") and not any(
                o["type"] == "message" for o in out.output):
            for chunk in out.text("message", ""):  # every answer without calls has a message, if empty
                yield chunk
        for chunk in out.close(item_status(d.finish_reason)):
            yield chunk
        for call in made:
            for chunk in out.call(call):
                yield chunk
        status, incomplete = finish_status(d.finish_reason)
        response = turn.response(status, out.output, d.usage, incomplete=incomplete)
        finished(turn, response, content, made)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        yield emit(kind, response=response)
