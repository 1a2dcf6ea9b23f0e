"""A streamed Message in Anthropic's event sequence, each event named on its `event:` line:
message_start, a ping, then per content block content_block_start, its deltas (thinking_delta,
text_delta, input_json_delta) and content_block_stop, then message_delta (stop_reason, usage) and
message_stop. An engine failure ends the stream with an `error` event.

Text that may be a tool call is held back (ToolCallStream, as on the OpenAI route) and sent at the
end as tool_use blocks, each with its whole input as one input_json_delta."""

from __future__ import annotations

from typing import AsyncIterator

from sse_starlette import ServerSentEvent

from exlcli.server.anthropic_errors import anthropic_error_body
from exlcli.server.anthropic_format import reasoning_splitter, stop_reason, unfinished_error, usage_body
from exlcli.server.generations import GenerationGroup
from exlcli.server.sse import SEP, sse_event
from exlcli.server.tool_calls import ToolCallStream, ToolPlan

_EMPTY_BLOCKS = {"text": {"type": "text", "text": ""},
                 "thinking": {"type": "thinking", "thinking": "", "signature": ""}}
_DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}


def ping_event() -> ServerSentEvent:
    """The keep-alive while a request waits: Anthropic's ping event (its SDKs skip it)."""
    return ServerSentEvent(data='{"type":"ping"}', event="ping", sep=SEP)


def _event(payload: dict) -> bytes:
    return sse_event(payload["type"], payload)


class _Blocks:
    """The content blocks sent so far: one open at a time, opened by the first piece of a new kind."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def start(self, block: dict) -> list[bytes]:
        out = self.stop()
        self.index += 1
        self.open = block["type"]
        out.append(_event({"type": "content_block_start", "index": self.index, "content_block": block}))
        return out

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event({"type": "content_block_stop", "index": self.index})]

    def piece(self, kind: str, text: str) -> list[bytes]:
        """A thinking or text piece, in the open block of its kind (or a new one)."""
        if not text:
            return []
        out = self.start(dict(_EMPTY_BLOCKS[kind])) if self.open != kind else []
        delta_type, key = _DELTAS[kind]
        out.append(_event({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": delta_type, key: text}}))
        return out

    def tool_use(self, call_id: str, name: str, arguments: str) -> list[bytes]:
        out = self.start({"type": "tool_use", "id": call_id, "name": name, "input": {}})
        out.append(_event({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "input_json_delta", "partial_json": arguments}}))
        return out


async def message_events(group: GenerationGroup, message_id: str, model: str,
                         plan: ToolPlan) -> AsyncIterator[bytes]:
    [choice] = group.choices
    prompt_tokens = choice.stream.prompt_tokens or 0
    yield _event({"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
    yield ping_event().encode()
    blocks = _Blocks()
    splitter = reasoning_splitter()
    calls = ToolCallStream(plan) if plan.active else None
    called = False

    def answer(parts: list[tuple[str, str]]) -> list[bytes]:
        out = []
        for kind, text in parts:
            if kind == "text" and calls is not None:
                text = calls.feed(text)
            out += blocks.piece(kind, text)
        return out

    async for item in group.deltas():
        d = item.delta
        if d.error:
            yield _event(anthropic_error_body(500, d.error))
            return
        for chunk in answer(splitter.feed(d.text)):
            yield chunk
        if not d.finished:
            continue
        for chunk in answer(splitter.finish()):
            yield chunk
        failed = unfinished_error(d.finish_reason)
        if failed is not None:
            yield _event(anthropic_error_body(failed.status, failed.message))
            return
        if calls is not None:
            last, _ = calls.finish(d.finish_reason)
            for delta in last:
                if "content" in delta:
                    for chunk in blocks.piece("text", delta["content"]):
                        yield chunk
                    continue
                [call] = delta["tool_calls"]
                if "id" in call:  # a call's first delta names it, its second holds its arguments
                    called = True
                    pending = (call["id"], call["function"]["name"])
                else:
                    for chunk in blocks.tool_use(*pending, call["function"]["arguments"]):
                        yield chunk
        for chunk in blocks.stop():
            yield chunk
        reason, sequence = stop_reason(d.finish_reason, d.stop_string, called)
        yield _event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                      "usage": usage_body(d.usage)})
        yield _event({"type": "message_stop"})
