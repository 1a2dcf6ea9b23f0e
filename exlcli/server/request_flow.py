"""The life of one generating request, shared by every API's routes (OpenAI's chat and text
completions in app.py, its Responses API in responses_api.py, Anthropic's Messages API in
anthropic_api.py): the grammars it brings checked, admitted and its generations started, then
answered whole or as a stream, cancelled when its client leaves."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, AsyncIterator, Callable

from fastapi import Request

from exlcli.engine.request import grammar_from_response_format
from exlcli.server import openai_format as fmt
from exlcli.server.bounded_work import OverBudget, run_bounded
from exlcli.server.generations import ChoiceResult, EngineFailure, GenerationGroup, Starter
from exlcli.server.grammar_workers import GrammarCheck
from exlcli.server.http_errors import APIError
from exlcli.server.sse import EventStreamResponse, PingFactory
from exlcli.server.tool_calls import ToolDef

if TYPE_CHECKING:
    from exlcli.server.app import ServerState


def grammar_checks(response_format: dict | None, tools: list[ToolDef] | None,
                   tool_param: str = "tools.{}.function.parameters",
                   format_param: str = "response_format") -> list[GrammarCheck]:
    """The grammars an OpenAI-shaped request brings: its response_format and each tool's parameter
    schema, each named by the field it came in (`tool_param` formatted with the tool's index)."""
    checks = []
    spec = grammar_from_response_format(response_format)  # its shape was checked with the body
    if spec is not None and spec.kind != "json_object":
        checks.append(GrammarCheck(format_param, spec.kind, spec.value, spec.strict))
    for i, tool in enumerate(tools or []):
        if tool.function.parameters is not None:
            checks.append(GrammarCheck(tool_param.format(i), "json_schema", tool.function.parameters))
    return checks


async def start_group(state: ServerState, endpoint: str, label: str, priority: str,
                      starters: list[Starter], response_id: str | None = None) -> GenerationGroup:
    """Admit the request (or 503), start its generations off the event loop, arm its time limit.
    `response_id`: the id its client gets (by default one of OpenAI's endpoint)."""
    state.admit(len(starters))
    response_id = response_id or fmt.new_id("chatcmpl" if endpoint == "chat" else "cmpl")
    group = GenerationGroup(response_id, endpoint, label, priority, state.tracker)
    state.num_starting += len(starters)
    try:
        await group.start(starters, state.tokenizing, state.config.start_budget_ms)
    except OverBudget as e:
        raise APIError(400, f"starting the request (chat template, tokenising) took longer than the limit of "
                       f"{e.budget_ms} ms", code="over_budget") from None
    finally:
        state.num_starting -= len(starters)
    if state.config.request_timeout_s is not None:
        group.timer = asyncio.get_running_loop().call_later(state.config.request_timeout_s, group.cancel)
    state.groups[group.response_id] = group
    return group


async def bounded(state: ServerState, what: str, fn: Callable):
    """Blocking work on a request's content (tokenising) in a worker thread, within the start budget."""
    try:
        return await run_bounded(state.tokenizing, fn, state.config.start_budget_ms)
    except OverBudget as e:
        raise APIError(400, f"{what} took longer than the limit of {e.budget_ms} ms", code="over_budget") from None


def event_stream(state: ServerState, group: GenerationGroup, events: AsyncIterator[bytes],
                 ping_factory: PingFactory | None = None) -> EventStreamResponse:
    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in events:
                yield chunk
        finally:
            group.abandon()
            state.groups.pop(group.response_id, None)

    return EventStreamResponse(guarded(), on_disconnect=group.cancel, headers={"X-Request-Id": group.response_id},
                               ping_s=state.config.sse_ping_s, ping_factory=ping_factory)


async def collect_unless_gone(state: ServerState, group: GenerationGroup,
                              request: Request) -> list[ChoiceResult] | None:
    """Collect a non-streaming answer, or cancel it if the client hangs up first (None)."""

    async def client_gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collector = asyncio.ensure_future(group.collect())
    watcher = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if collector.done():
            try:
                return collector.result()
            except EngineFailure as e:
                status, kind = e.api_status()
                raise APIError(status, str(e), kind, code=e.code) from None
        group.cancel()
        return None
    finally:
        for task in (collector, watcher):
            task.cancel()
        group.abandon()
        state.groups.pop(group.response_id, None)
