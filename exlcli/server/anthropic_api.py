"""Anthropic's Messages API over the same engine and machinery as the OpenAI routes:
POST /v1/messages (whole or streamed) and POST /v1/messages/count_tokens. Errors on these paths
take Anthropic's shape (anthropic_errors.py); the key may come as `x-api-key` (security.py), and
the `anthropic-version` and `anthropic-beta` headers are accepted (the API's shape does not depend
on them here)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from exlcli.client.base import GenerationStream
from exlcli.server import anthropic_format as afmt
from exlcli.server.anthropic_events import message_events, ping_event
from exlcli.server.generations import Starter
from exlcli.server.request_flow import bounded, collect_unless_gone, event_stream, start_group

if TYPE_CHECKING:
    from exlcli.server.app import ServerState


def add_messages_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/messages")
    async def messages(body: afmt.MessagesRequest, request: Request) -> Response:
        client = await state.client_for(body.model)
        chat = afmt.chat_messages(body)
        plan = afmt.tool_plan(body, client.tool_format())
        state.check_prompt_size(afmt.prompt_parts(chat, plan), client)
        await state.check_grammars(afmt.grammar_checks(plan))

        def start() -> GenerationStream:  # in a worker thread: the forcing grammar is built here
            return client.chat(chat, plan.apply(body.generation_params(client.context_length)))

        message_id = afmt.new_message_id()
        group = await start_group(state, "messages", body.client or "api", body.priority or "interactive",
                                  [Starter(0, 0, start)], response_id=message_id)
        if body.stream:
            return event_stream(state, group, message_events(group, message_id, client.model_name, plan),
                                ping_factory=ping_event)
        results = await collect_unless_gone(state, group, request)
        if results is None:
            return Response(status_code=499)
        [result] = results
        failed = afmt.unfinished_error(result.finish_reason)
        if failed is not None:
            raise failed
        return JSONResponse(afmt.message_body(message_id, client.model_name, result, plan))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: afmt.CountTokensRequest) -> dict:
        client = await state.client_for(body.model)
        chat = afmt.chat_messages(body)
        plan = afmt.tool_plan(body, client.tool_format())
        state.check_prompt_size(afmt.prompt_parts(chat, plan), client)
        count = await bounded(state, "tokenizing", partial(client.count_chat_tokens, chat, True, plan.tools or None))
        return {"input_tokens": count}
