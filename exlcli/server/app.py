"""The ASGI app: OpenAI-shaped endpoints over one EngineClient.

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (both with `stream`),
GET /health, GET /metrics, and for exlcli's own RemoteClient: POST /tokenize, GET /stats,
POST /cancel/{response_id}. Every error body has OpenAI's shape {"error": {...}}.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exlcli.client.base import EngineClient
from exlcli.errors import ExlcliError
from exlcli.server import openai_format as fmt
from exlcli.server.generations import ChoiceResult, EngineFailure, GenerationGroup, Starter
from exlcli.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from exlcli.server.metrics import render_metrics
from exlcli.server.schemas import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from exlcli.server.security import DEFAULT_MAX_BODY_BYTES, BodySizeLimit, bearer_token, key_matches
from exlcli.server.sse import DONE, EventStreamResponse, sse_data
from exlcli.server.tracker import RequestTracker

log = logging.getLogger("exlcli.server")

# Engine streams are iterated in worker threads by some clients; the default pool (cpu + 4 threads)
# would cap concurrency far below what the engine batches.
MAX_WORKER_THREADS = 512
KNOWN_ENDPOINTS = {"/v1/models", "/v1/chat/completions", "/v1/completions", "/health", "/metrics",
                   "/tokenize", "/stats"}


@dataclass
class ServerConfig:
    api_key: str | None = None
    max_queue: int = 256  # generations allowed to wait for the engine before 503
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens: int = 2048  # when a request names no max_tokens
    retry_after_s: int = 2


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(fmt.error_body(self.message, self.kind, self.param, self.code),
                            status_code=self.status, headers=self.headers)


@dataclass
class ServerState:
    client: EngineClient
    config: ServerConfig
    tracker: RequestTracker
    draining: bool = False
    groups: dict[str, GenerationGroup] = field(default_factory=dict)  # by response id, in flight
    num_starting: int = 0  # admitted, streams being started: counted as waiting

    def num_waiting(self) -> int:
        return self.tracker.num_waiting(self.client.stats()) + self.num_starting

    def admit(self, num_generations: int) -> None:
        if self.draining:
            self.tracker.rejected_by_reason["draining"] += 1
            raise APIError(503, "the server is shutting down", "server_error", code="draining",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        waiting = self.num_waiting()
        if waiting + num_generations > self.config.max_queue:
            self.tracker.rejected_by_reason["queue_full"] += 1
            raise APIError(503, f"the server is busy: {waiting} requests are waiting (limit "
                           f"{self.config.max_queue}); retry later", "server_error", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)})

    def token_text(self, token_id: int) -> str:
        # EngineClient has no detokeniser; an in-process client exposes its tokenizer, a fake has
        # none, in which case the id is named as vLLM does.
        fn = getattr(self.client, "token_text", None)
        if callable(fn):
            return fn(token_id)
        tokenizer = getattr(self.client, "tokenizer", None)
        if tokenizer is not None and hasattr(tokenizer, "decode"):
            return tokenizer.decode([token_id], skip_special_tokens=False)
        return f"token_id:{token_id}"


def create_app(client: EngineClient, config: ServerConfig | None = None,
               tracker: RequestTracker | None = None) -> FastAPI:
    config = config or ServerConfig()
    state = ServerState(client, config, tracker or RequestTracker())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(MAX_WORKER_THREADS, thread_name_prefix="exlcli-stream")
        loop.set_default_executor(pool)
        yield
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="exlcli", version="0.1", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.exlcli = state
    app.add_middleware(ResponseCounter, tracker=state.tracker)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    _install_error_handlers(app)

    def require_key(request: Request) -> None:
        if config.api_key is None:
            return
        if not key_matches(bearer_token(request.headers.get("authorization")), config.api_key):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")

    auth = [Depends(require_key)]

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": "draining" if state.draining else "ok", "model": client.model_name}
        return JSONResponse(body, status_code=503 if state.draining else 200)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return fmt.model_list(client.model_name, client.context_length, fmt.now())

    @app.get("/metrics", dependencies=auth)
    async def metrics() -> Response:
        stats = client.stats()
        text = render_metrics(stats, state.tracker, state.tracker.num_waiting(stats) + state.num_starting)
        return Response(text, media_type=METRICS_CONTENT_TYPE)

    @app.get("/stats", dependencies=auth)
    async def stats() -> dict:
        return dataclasses.asdict(client.stats())

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest) -> dict:
        count = await asyncio.to_thread(client.count_chat_tokens, body.message_dicts(), body.add_generation_prompt)
        return {"count": count, "max_model_len": client.context_length}

    @app.post("/cancel/{response_id}", dependencies=auth)
    async def cancel(response_id: str) -> dict:
        group = state.groups.get(response_id)
        if group is None:
            raise APIError(404, f"no request {response_id!r} is running", code="not_found")
        group.cancel()
        return {"id": response_id, "cancelled": True}

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        messages = body.message_dicts()
        starters = [Starter(i, 0, partial(client.chat, messages, body.generation_params(i, config.default_max_tokens)))
                    for i in range(body.num_choices)]
        group = await _start(state, "chat", body.client or "api", body.priority or "interactive", starters)
        if body.streaming:
            return _event_stream(state, group, _chat_events(state, group, body))
        results = await _collect_unless_gone(state, group, request)
        if results is None:
            return Response(status_code=499)
        num_top = body.top_logprobs or 0
        return JSONResponse(fmt.chat_completion(
            group.response_id, fmt.now(), client.model_name, results,
            lambda c: fmt.chat_logprobs(c.logprobs, state.token_text, num_top) if body.logprobs else None))

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        n = body.num_choices
        starters = [Starter(p * n + j, p, partial(client.complete, prompt, body.generation_params(j, config.default_max_tokens)))
                    for p, prompt in enumerate(body.prompts()) for j in range(n)]
        group = await _start(state, "completions", body.client or "api", body.priority or "interactive", starters)
        if body.streaming:
            return _event_stream(state, group, _completion_events(state, group, body))
        results = await _collect_unless_gone(state, group, request)
        if results is None:
            return Response(status_code=499)
        prompts = body.prompts()
        num_top = body.logprobs or 0
        for r in results:
            if body.echo:
                r.text = prompts[r.prompt_index] + r.text
        return JSONResponse(fmt.text_completion(
            group.response_id, fmt.now(), client.model_name, results,
            lambda c: fmt.completion_logprobs(
                c.logprobs, state.token_text, num_top,
                [o + (len(prompts[c.prompt_index]) if body.echo else 0) for o in c.logprob_offsets])
            if body.logprobs is not None else None))

    return app


async def _start(state: ServerState, endpoint: str, label: str, priority: str,
                 starters: list[Starter]) -> GenerationGroup:
    state.admit(len(starters))
    prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
    group = GenerationGroup(fmt.new_id(prefix), endpoint, label, priority, state.tracker)
    state.num_starting += len(starters)
    try:
        await group.start(starters)
    finally:
        state.num_starting -= len(starters)
    state.groups[group.response_id] = group
    return group


def _event_stream(state: ServerState, group: GenerationGroup, events: AsyncIterator[bytes]) -> EventStreamResponse:
    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in events:
                yield chunk
        finally:
            group.abandon()
            state.groups.pop(group.response_id, None)

    return EventStreamResponse(guarded(), on_disconnect=group.cancel,
                               headers={"X-Request-Id": group.response_id})


async def _collect_unless_gone(state: ServerState, group: GenerationGroup,
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
                raise APIError(500, str(e), "server_error") from None
        group.cancel()
        return None
    finally:
        for task in (collector, watcher):
            task.cancel()
        group.abandon()
        state.groups.pop(group.response_id, None)


async def _chat_events(state: ServerState, group: GenerationGroup, body: ChatCompletionRequest) -> AsyncIterator[bytes]:
    rid, created, model = group.response_id, fmt.now(), state.client.model_name
    num_top = body.top_logprobs or 0
    usages = []
    for c in group.choices:
        yield sse_data(fmt.chat_chunk(rid, created, model, c.index, {"role": "assistant", "content": ""}))
    async for item in group.deltas():
        d, index = item.delta, item.choice.index
        if d.error:
            yield sse_data(fmt.error_body(d.error, "server_error"))
            return
        if d.text or d.logprobs or (body.return_token_ids and d.token_ids):
            logprobs = fmt.chat_logprobs(d.logprobs or [], state.token_text, num_top) if body.logprobs else None
            yield sse_data(fmt.chat_chunk(rid, created, model, index, {"content": d.text}, logprobs=logprobs,
                                          token_ids=d.token_ids if body.return_token_ids else None))
        if d.finished:
            usages.append((item.choice.prompt_index, d.usage))
            yield sse_data(fmt.chat_chunk(rid, created, model, index, {}, finish_reason=d.finish_reason))
    if body.include_usage_chunk:
        yield sse_data(fmt.usage_chunk(rid, created, model, "chat.completion.chunk", usages))
    yield DONE


async def _completion_events(state: ServerState, group: GenerationGroup, body: CompletionRequest) -> AsyncIterator[bytes]:
    rid, created, model = group.response_id, fmt.now(), state.client.model_name
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
            yield sse_data(fmt.error_body(d.error, "server_error"))
            return
        logprobs = None
        if body.logprobs is not None and d.logprobs:
            logprobs = fmt.completion_logprobs(d.logprobs, state.token_text, num_top,
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


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers a bad body with 400 and one message, not FastAPI's 422 with a list.
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": ")).response()
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid value").removeprefix("Value error, ")
        return APIError(400, f"{param}: {message}" if param else message, param=param).response()

    @app.exception_handler(ExlcliError)
    async def refused(request: Request, exc: ExlcliError) -> JSONResponse:
        return APIError(400, str(exc)).response()  # RequestError: prompt too long, bad parameters

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", "server_error").response()


class ResponseCounter:
    """ASGI middleware counting responses by endpoint and status, for /metrics."""

    def __init__(self, app: ASGIApp, tracker: RequestTracker) -> None:
        self.app = app
        self.tracker = tracker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in KNOWN_ENDPOINTS else ("/cancel" if path.startswith("/cancel/") else "other")

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.tracker.count_response(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
