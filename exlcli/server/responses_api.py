"""OpenAI's Responses API over the server's engine: POST /v1/responses (whole or streamed),
GET and DELETE /v1/responses/{id}.

A response is one chat generation: `instructions`, the stored conversation of
`previous_response_id` and the new input items become chat messages, answered as chat completions
are (the same admission, tools, grammar checks and cancellation). A stored conversation runs under
one engine session, so each next turn resumes the cache the last one left; a conversation sent
whole each turn (`store: false`, as Codex does) gets the same from its `prompt_cache_key`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from exlcli.client.base import EngineClient, GenerationStream
from exlcli.server.generations import ReasoningPlan, Starter
from exlcli.server.http_errors import APIError
from exlcli.server.request_flow import collect_unless_gone, event_stream, grammar_checks, start_group
from exlcli.server.responses_conversation import Conversation, prompt_messages
from exlcli.server.responses_events import response_events
from exlcli.server.responses_format import Turn, finish_status, new_id, output_items
from exlcli.server.responses_request import ResponsesRequest
from exlcli.server.responses_store import ResponseStore, StoredResponse
from exlcli.server.schemas import ParamError
from exlcli.server.security import request_api_key, scoped_session
from exlcli.server.tool_calls import ToolPlan
from exlcli.text.tool_formats import ToolCall

if TYPE_CHECKING:
    from exlcli.server.app import ServerState


def add_responses_routes(app: FastAPI, state: ServerState) -> ResponseStore:
    store = ResponseStore(state.config.max_stored_responses)

    def key_of(request: Request) -> str | None:
        if state.config.api_key is None:
            return None
        return request_api_key(request.headers.get("authorization"), request.headers.get("x-api-key"))

    def owner_of(request: Request) -> str:
        return scoped_session(key_of(request), "")  # "" without a key, else a digest of it

    def not_found(response_id: str) -> APIError:
        return APIError(404, f"no response with id {response_id!r} is stored (it was never stored, was deleted, or "
                             f"made room for newer ones)", param="response_id", code="not_found")

    def begin(body: ResponsesRequest, request: Request, client: EngineClient) -> Turn:
        """The turn's conversation and session, checked against the model and the stored responses."""
        state.check(body, client)  # the served model, max_output_tokens, the new input's size
        owner = owner_of(request)
        history, session = [], None
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id, owner)
            if previous is None:
                raise APIError(400, f"previous response with id {body.previous_response_id!r} not found",
                               param="previous_response_id", code="previous_response_not_found")
            history, session = previous.history, previous.session
        conversation = Conversation.of(history)
        try:
            conversation.add_items(body.items())
        except ParamError as e:  # a function_call_output for no call of the conversation
            raise APIError(400, str(e), param=e.param) from None
        parts = body.prompt_parts()
        parts["previous_response_id"] = history_bytes(history)
        state.check_prompt_size(parts, client)
        response_id = new_id("resp")
        if session is None and (body.prompt_cache_key or body.storing):
            name = f"resp:{body.prompt_cache_key}" if body.prompt_cache_key else f"resp:{response_id}"
            session = scoped_session(key_of(request), name)
        params = body.generation_params(0, state.config.default_max_tokens)
        params.session = session
        plan = ToolPlan.for_request(body.tool_defs(), body.chat_tool_choice(), body.parallel_tool_calls,
                                    client.tool_format())
        return Turn(response_id, client.model_name, body, plan, params, conversation, session, owner)

    def finished(turn: Turn, response: dict, content: str, calls: list[ToolCall]) -> None:
        if turn.body.storing and response["status"] in ("completed", "incomplete"):
            store.put(turn.response_id, StoredResponse(response, turn.history_after(content, calls), turn.session,
                                                       turn.owner))

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        client = await state.client_for(body.model)
        turn = begin(body, request, client)
        await state.check_grammars(grammar_checks(body.response_format, body.tool_defs(), "tools.{}.parameters",
                                                  "text.format"))
        messages = prompt_messages(body.instructions, turn.conversation.messages)

        def start() -> GenerationStream:  # in a worker thread: the forcing grammar is built here
            return client.chat(messages, turn.plan.apply(turn.params))

        group = await start_group(state, "responses", body.client or "api", body.priority or "interactive",
                                  [Starter(0, 0, start)], response_id=turn.response_id)
        constrained = turn.plan.required or (body.response_format or {}).get("type", "text") != "text"
        group.reasoning = ReasoningPlan.for_client(client, state.config.reasoning_format, constrained)
        if body.streaming:
            return event_stream(state, group, response_events(group, turn, finished))
        results = await collect_unless_gone(state, group, request)
        if results is None:
            return Response(status_code=499)
        result = results[0]
        output, content, calls = output_items(result, turn.plan)
        status, incomplete = finish_status(result.finish_reason)
        response = turn.response(status, output, result.usage, incomplete=incomplete)
        finished(turn, response, content, calls)
        return JSONResponse(response)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict:
        stored = store.get(response_id, owner_of(request))
        if stored is None:
            raise not_found(response_id)
        return stored.response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict:
        if not store.delete(response_id, owner_of(request)):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return store


def history_bytes(messages: list[dict]) -> int:
    """UTF-8 size of what the template writes of stored messages (texts, calls and their ids)."""
    total = 0
    for m in messages:
        total += len((m.get("content") or "").encode()) + len((m.get("tool_call_id") or "").encode())
        for c in m.get("tool_calls") or []:
            total += len(c["id"].encode()) + len(c["function"]["name"].encode()) \
                + len(c["function"]["arguments"].encode())
    return total
