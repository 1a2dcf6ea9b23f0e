"""The ASGI app: OpenAI-shaped endpoints over one EngineClient.

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (both with `stream`),
GET /health, GET /metrics, and for exlcli's own RemoteClient: POST /tokenize, GET /stats,
POST /cancel/{response_id}. Every error body has OpenAI's shape {"error": {...}}.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from exlcli.client.base import EngineClient
from exlcli.server import openai_format as fmt
from exlcli.server.events import chat_events, completion_events
from exlcli.server.generations import ChoiceResult, EngineFailure, GenerationGroup, Starter
from exlcli.server.http_errors import APIError, install_error_handlers
from exlcli.server.metrics import EngineCollector, ResponseCounter, render_metrics
from exlcli.server.rates import EngineRates
from exlcli.server.schemas import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from exlcli.server.security import DEFAULT_MAX_BODY_BYTES, BodySizeLimit, bearer_token, key_matches
from exlcli.server.sse import DEFAULT_PING_S, EventStreamResponse
from exlcli.server.tracker import RequestTracker

# Engine streams are iterated in worker threads by some clients; the default pool (cpu + 4 threads)
# would cap concurrency far below what the engine batches.
MAX_WORKER_THREADS = 512


@dataclass
class ServerConfig:
    api_key: str | None = None
    max_queue: int = 256  # generations allowed to wait for the engine before 503
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens: int = 2048  # when a request names no max_tokens
    retry_after_s: int = 2
    sse_ping_s: float = DEFAULT_PING_S  # keep-alive comment on a stream with nothing to send


@dataclass
class ServerState:
    client: EngineClient
    config: ServerConfig
    tracker: RequestTracker
    draining: bool = False
    groups: dict[str, GenerationGroup] = field(default_factory=dict)  # by response id, in flight
    num_starting: int = 0  # admitted, streams being started: counted as waiting
    rates: EngineRates = field(default_factory=EngineRates)  # tok/s and batch size that fall to 0 when idle

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
            return tokenizer.decode([token_id])  # special tokens (the closing EOS) read as "", as in the text
        return f"token_id:{token_id}"


def create_app(client: EngineClient, config: ServerConfig | None = None,
               tracker: RequestTracker | None = None) -> FastAPI:
    config = config or ServerConfig()
    state = ServerState(client, config, tracker or RequestTracker(model_name=client.model_name))
    state.tracker.registry.register(EngineCollector(state))

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
    install_error_handlers(app)

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
    async def metrics(request: Request) -> Response:
        body, content_type = render_metrics(state.tracker, request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

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
        messages, max_tokens = body.message_dicts(), config.default_max_tokens
        starters = [Starter(i, 0, partial(client.chat, messages, body.generation_params(i, max_tokens)))
                    for i in range(body.num_choices)]
        group = await _start(state, "chat", body.client or "api", body.priority or "interactive", starters)
        if body.streaming:
            return _event_stream(state, group, chat_events(group, body, client.model_name, state.token_text))
        results = await _collect_unless_gone(state, group, request)
        if results is None:
            return Response(status_code=499)
        num_top = body.top_logprobs or 0
        return JSONResponse(fmt.chat_completion(
            group.response_id, fmt.now(), client.model_name, results,
            lambda c: fmt.chat_logprobs(c.logprobs, state.token_text, num_top) if body.logprobs else None))

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        n, max_tokens = body.num_choices, config.default_max_tokens
        starters = [Starter(p * n + j, p, partial(client.complete, prompt, body.generation_params(j, max_tokens)))
                    for p, prompt in enumerate(body.prompts()) for j in range(n)]
        group = await _start(state, "completions", body.client or "api", body.priority or "interactive", starters)
        if body.streaming:
            return _event_stream(state, group, completion_events(group, body, client.model_name, state.token_text))
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


def _event_stream(state: ServerState, group: GenerationGroup,
                  events: AsyncIterator[bytes]) -> EventStreamResponse:
    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in events:
                yield chunk
        finally:
            group.abandon()
            state.groups.pop(group.response_id, None)

    return EventStreamResponse(guarded(), on_disconnect=group.cancel, headers={"X-Request-Id": group.response_id},
                               ping_s=state.config.sse_ping_s)


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


