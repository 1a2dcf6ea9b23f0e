"""The server-sent event streams of chat and text completions, chunk by chunk as OpenAI sends
them: a role chunk first (chat), content deltas, one finish chunk per choice, an optional usage
chunk, then [DONE]. An engine error ends the stream with an error event.

Chat deltas carry the model's reasoning apart, as `{"reasoning_content": ...}` (vLLM's and
llama-server's field), when the group splits it (generations.ReasoningPlan)."""

from __future__ import annotations

from typing import AsyncIterator, Callable

from exlcli.client.base import TextDelta
from exlcli.server import openai_format as fmt
from exlcli.server.generations import GRAMMAR_MISMATCH, GenerationGroup
from exlcli.server.schemas import ChatCompletionRequest, CompletionRequest
from exlcli.server.sse import DONE, sse_data
from exlcli.server.tool_calls import ToolCallStream, ToolPlan


async def chat_events(group: GenerationGroup, body: ChatCompletionRequest, model: str,
                      token_text: Callable[[int], str], tools: ToolPlan | None = None) -> AsyncIterator[bytes]:
    rid, created = group.response_id, fmt.now()
    num_top = body.top_logprobs or 0
    usages = []
    # with tools, text that may be a call is held back and sent at the end as tool_calls deltas
    calls = {c.index: ToolCallStream(tools) for c in group.choices} if tools is not None and tools.active else {}
    for c in group.choices:
        yield sse_data(fmt.chat_chunk(rid, created, model, c.index, {"role": "assistant", "content": ""}))
    async for item in group.deltas():
        d, index = item.delta, item.choice.index
        if d.error:
            yield sse_data(stream_error(d))
            return
        if item.reasoning:
            yield sse_data(fmt.chat_chunk(rid, created, model, index, {"reasoning_content": item.reasoning}))
        text = calls[index].feed(item.content) if calls else item.content
        if text or d.logprobs or (body.return_token_ids and d.token_ids):
            logprobs = fmt.chat_logprobs(d.logprobs or [], token_text, num_top) if body.logprobs else None
            yield sse_data(fmt.chat_chunk(rid, created, model, index, {"content": text}, logprobs=logprobs,
                                          token_ids=d.token_ids if body.return_token_ids else None))
        for delta in calls[index].ready() if calls else ():  # calls whose blocks closed
            yield sse_data(fmt.chat_chunk(rid, created, model, index, delta))
        if d.finished:
            usages.append((item.choice.prompt_index, d.usage))
            reason = d.finish_reason
            if calls:
                last, reason = calls[index].finish(reason)
                for delta in last:
                    yield sse_data(fmt.chat_chunk(rid, created, model, index, delta))
            yield sse_data(fmt.chat_chunk(rid, created, model, index, {}, finish_reason=reason))
    if body.include_usage_chunk:
        yield sse_data(fmt.usage_chunk(rid, created, model, "chat.completion.chunk", usages))
    yield DONE


async def completion_events(group: GenerationGroup, body: CompletionRequest, model: str,
                            token_text: Callable[[int], str]) -> AsyncIterator[bytes]:
    rid, created = group.response_id, fmt.now()
    prompts = body.prompts()
    num_top = body.logprobs or 0
    offsets = {c.index: len(prompts[c.prompt_index]) if body.echo else 0 for c in group.choices}
    usages = []
    if body.echo:
        for c in group.choices:
            yield sse_data(fmt.completion_chunk(rid, created, model, c.index, prompts[c.prompt_index]))
    async for item in group.deltas():
        d, index = item.delta, item.choice.index
        if d.error:
            yield sse_data(stream_error(d))
            return
        logprobs = None
        if body.logprobs is not None and d.logprobs:
            logprobs = fmt.completion_logprobs(d.logprobs, token_text, num_top,
                                               [offsets[index]] * len(d.logprobs))
        offsets[index] += len(d.text)
        if d.finished:
            usages.append((item.choice.prompt_index, d.usage))
        if d.text or d.finished or logprobs or (body.return_token_ids and d.token_ids):
            yield sse_data(fmt.completion_chunk(rid, created, model, index, d.text,
                                                finish_reason=d.finish_reason, logprobs=logprobs,
                                                token_ids=d.token_ids if body.return_token_ids else None))
    if body.include_usage_chunk:
        yield sse_data(fmt.usage_chunk(rid, created, model, "text_completion", usages))
    yield DONE


def stream_error(delta: TextDelta) -> dict:
    """The error event that ends a stream: a grammar mismatch is the request's, anything else the server's."""
    kind = "invalid_request_error" if delta.error_code == GRAMMAR_MISMATCH else "server_error"
    return fmt.error_body(delta.error or "engine error", kind, code=delta.error_code)
