"""The ASGI app: OpenAI's and Anthropic's endpoints over the served models (a ModelPool of
EngineClients).

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (both with `stream`),
POST /v1/responses, GET and DELETE /v1/responses/{id} (responses_api.py), POST /v1/messages and
POST /v1/messages/count_tokens (anthropic_api.py), POST /v1/embeddings, GET /health, GET /metrics,
and for exlcli's own RemoteClient: POST /tokenize, GET /stats, POST /cancel/{response_id}. Every
error body has OpenAI's shape {"error": {...}}, but on the routes of Anthropic's Messages API, which
take Anthropic's.

Every route that runs a model gets its engine from `await state.client_for(body.model)`: the model
the request names (the default when it names none), loaded on first use, leased to the request
until its response is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from exlcli.client.base import EngineClient, GenerationParams, GenerationStream
from exlcli.engine.stats import EngineStats
from exlcli.errors import RequestError
from exlcli.server import openai_format as fmt
from exlcli.server.anthropic_api import add_messages_routes
from exlcli.server.bounded_work import DEFAULT_START_BUDGET_MS
from exlcli.server.events import chat_events, completion_events
from exlcli.server.generations import GenerationGroup, ReasoningPlan, Starter
from exlcli.server.grammar_workers import (
    DEFAULT_GRAMMAR_BUDGET_MS,
    DEFAULT_MAX_GRAMMAR_CHECKS,
    GrammarCheck,
    GrammarRejected,
    GrammarWorkers,
)
from exlcli.server.http_errors import APIError, install_error_handlers
from exlcli.server.metrics import EngineCollector, ResponseCounter, render_metrics
from exlcli.server.model_pool import ModelLeases, ModelPool
from exlcli.server.rates import EngineRates
from exlcli.server.request_flow import bounded, collect_unless_gone, event_stream, grammar_checks, start_group
from exlcli.server.responses_api import add_responses_routes
from exlcli.server.responses_store import DEFAULT_MAX_STORED
from exlcli.server.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, TokenizeRequest
from exlcli.server.security import (
    DEFAULT_MAX_BODY_BYTES,
    APIKeyGate,
    BodySizeLimit,
    HostAllowList,
    request_api_key,
    scoped_session,
)
from exlcli.server.sse import DEFAULT_PING_S
from exlcli.server.tool_calls import ToolPlan, rewrite_completion
from exlcli.server.tracker import RequestTracker

# Engine streams are iterated in worker threads by some clients; the default pool (cpu + 4 threads)
# would cap concurrency far below what the engine batches.
MAX_WORKER_THREADS = 512
HEALTH_PATH = "/health"
# No tokenizer we ship has tokens of more than 16 bytes on average over real text, so a prompt of
# more than 32 bytes per token of context cannot fit; it is refused before any tokenising.
PROMPT_BYTES_PER_TOKEN = 32


@dataclass
class ServerConfig:
    api_key: str | None = None
    max_queue: int = 256  # generations allowed to wait for the engine before 503
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens: int = 2048  # when a request names no max_tokens
    retry_after_s: int = 2
    sse_ping_s: float = DEFAULT_PING_S  # keep-alive comment on a stream with nothing to send
    model_aliases: tuple[str, ...] = ()  # names accepted in "model" besides the served one
    allowed_hosts: tuple[str, ...] | None = None  # Host header names accepted (None: any)
    cors_origins: tuple[str, ...] = ()  # browser origins allowed by CORS (none: CORS off)
    max_prompt_bytes: int | None = None  # refused before tokenising; None: PROMPT_BYTES_PER_TOKEN x context
    max_tokenizing: int = 2  # prompts tokenised at once, in worker threads
    start_budget_ms: int = DEFAULT_START_BUDGET_MS  # a start (template, tokenising) past this is a 400
    max_grammar_checks: int = DEFAULT_MAX_GRAMMAR_CHECKS  # grammar checks at once, in worker processes
    grammar_budget_ms: int = DEFAULT_GRAMMAR_BUDGET_MS  # a request's grammar checks past this are a 400
    request_timeout_s: float | None = 600.0  # a generation still running after this is cancelled
    reasoning_format: str = "auto"  # auto: reasoning apart (reasoning_content); none: inline (--reasoning-format)
    max_stored_responses: int = DEFAULT_MAX_STORED  # kept for previous_response_id (responses_store.py)


@dataclass
class ServerState:
    pool: ModelPool  # (an EngineClient is served as a pool of one)
    config: ServerConfig
    tracker: RequestTracker
    draining: bool = False
    groups: dict[str, GenerationGroup] = field(default_factory=dict)  # by response id, in flight
    num_starting: int = 0  # admitted, streams being started: counted as waiting
    rates: EngineRates = field(default_factory=EngineRates)  # tok/s and batch size that fall to 0 when idle
    tokenizing: asyncio.Semaphore = field(init=False)  # bounds prompts tokenised at once
    grammars: GrammarWorkers = field(init=False)  # grammar checks, with slots of their own

    def __post_init__(self) -> None:
        if not isinstance(self.pool, ModelPool):
            self.pool = ModelPool.of_client(self.pool, self.config.model_aliases)
        self.tokenizing = asyncio.Semaphore(self.config.max_tokenizing)
        self.grammars = GrammarWorkers(self.config.max_grammar_checks, self.config.grammar_budget_ms)

    async def client_for(self, model: str | None) -> EngineClient:
        """The engine of the model a request names (None: the default), loaded on first use and
        leased to the request until its response is sent; a 404 naming a model not served, a 500
        naming one that fails to load."""
        return await self.pool.acquire(model)

    @property
    def client(self) -> EngineClient:
        """The default model's engine (loaded on this thread if it is not): for callers that name no
        model. Routes use client_for."""
        return self.pool.client_now(self.pool.default)

    def engine_view(self) -> tuple[str, EngineStats]:
        """The engine the display and /metrics show: the default model's, else the one used last
        (empty stats while none is loaded). Never loads one."""
        loaded = sorted(self.pool.loaded(), key=lambda m: (m is not self.pool.default, -m.last_used))
        if not loaded or loaded[0].client is None:
            return self.pool.default.name, EngineStats()
        return loaded[0].name, loaded[0].client.stats()

    def loaded_clients(self) -> list[EngineClient]:
        return [m.client for m in self.pool.loaded() if m.client is not None]

    def num_waiting(self) -> int:
        for client in self.loaded_clients()[1:]:  # request ids are unique across the process's engines
            self.tracker.merge_engine_view(client.stats().active)
        clients = self.loaded_clients()
        return self.tracker.num_waiting(clients[0].stats() if clients else None) + self.num_starting

    def admit(self, num_generations: int) -> None:
        if num_generations > self.config.max_queue:
            raise APIError(400, f"the request needs {num_generations} generations, more than this server ever queues "
                           f"({self.config.max_queue}, --max-queue); lower n or send fewer prompts", param="n")
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

    def check(self, body: ChatCompletionRequest | CompletionRequest, client: EngineClient | None = None) -> None:
        """What the schema cannot know: the served models' names, the model's context (`client`: the
        model's engine, from client_for; None: the default's), the prompt cap."""
        self.check_model(body.model)
        client = client or self.client
        context = client.context_length
        max_tokens = body.generation_params(0, self.config.default_max_tokens).max_tokens
        if body.max_tokens_param in body.model_fields_set and max_tokens > context:
            raise APIError(400, f"{body.max_tokens_param} is {max_tokens}, more than the model's context of "
                           f"{context} tokens", param=body.max_tokens_param)
        self.check_prompt_size(body.prompt_parts(), client)

    def check_model(self, model: str | None) -> None:
        self.pool.find(model)  # a 404 naming a model not served

    def check_prompt_size(self, parts: dict[str, int], client: EngineClient | None = None) -> None:
        """Every field that reaches the template or the tokenizer counts (messages, tool calls and
        their arguments, tool descriptions and schemas), before any rendering or tokenising."""
        context = (client or self.client).context_length
        limit = self.config.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * context
        total = sum(parts.values())
        if total > limit:
            param = max(parts, key=lambda k: parts[k])
            raise APIError(400, f"the prompt is {total} bytes ({param}: {parts[param]}); more than {limit} bytes "
                           f"cannot fit the model's context of {context} tokens", param=param,
                           code="context_length_exceeded")

    def params(self, body: ChatCompletionRequest | CompletionRequest, index: int, request: Request) -> GenerationParams:
        """Choice `index`'s parameters; with an API key, its session is the key's (scoped_session)."""
        params = body.generation_params(index, self.config.default_max_tokens)
        if params.session is not None and self.config.api_key is not None:
            key = request_api_key(request.headers.get("authorization"), request.headers.get("x-api-key"))
            params.session = scoped_session(key, params.session)
        return params

    async def check_grammars(self, checks: list[GrammarCheck]) -> None:
        try:
            await self.grammars.check(checks)
        except GrammarRejected as e:
            raise APIError(400, str(e), param=e.param) from None

    def token_text(self, token_id: int, client: EngineClient | None = None) -> str:
        return token_text(client or self.client, token_id)


def token_text(client: EngineClient, token_id: int) -> str:
    # EngineClient has no detokeniser; an in-process client exposes its tokenizer, a fake has
    # none, in which case the id is named as vLLM does.
    fn = getattr(client, "token_text", None)
    if callable(fn):
        return fn(token_id)
    tokenizer = getattr(client, "tokenizer", None)
    if tokenizer is not None and hasattr(tokenizer, "decode"):
        return tokenizer.decode([token_id])  # special tokens (the closing EOS) read as "", as in the text
    return f"token_id:{token_id}"


def create_app(served: EngineClient | ModelPool, config: ServerConfig | None = None,
               tracker: RequestTracker | None = None) -> FastAPI:
    """`served`: one engine, or the pool of the served models (the caller closes them afterwards)."""
    config = config or ServerConfig()
    pool = served if isinstance(served, ModelPool) else ModelPool.of_client(served, config.model_aliases)
    state = ServerState(pool, config, tracker or RequestTracker(model_name=pool.default.name))
    state.tracker.registry.register(EngineCollector(state))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        threads = ThreadPoolExecutor(MAX_WORKER_THREADS, thread_name_prefix="exlcli-stream")
        loop.set_default_executor(threads)
        reaper = asyncio.ensure_future(pool.run_reaper())
        yield
        reaper.cancel()
        state.grammars.close()
        threads.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="exlcli", version="0.1", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.exlcli = state
    # The last added runs first: count every response (413 and 401 too), then the Host check, CORS,
    # the key (before any body is read), the body's size.
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    if config.api_key is not None:
        app.add_middleware(APIKeyGate, api_key=config.api_key, open_paths=(HEALTH_PATH,))
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins),
                           allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version",
                                          "anthropic-beta"])
    if config.allowed_hosts is not None:
        app.add_middleware(HostAllowList, allowed=config.allowed_hosts)
    app.add_middleware(ResponseCounter, tracker=state.tracker)
    app.add_middleware(ModelLeases, pool=pool)
    install_error_handlers(app)
    app.state.responses = add_responses_routes(app, state)  # /v1/responses (responses_api.py)
    add_messages_routes(app, state)  # Anthropic's Messages API (anthropic_api.py)

    @app.get(HEALTH_PATH)
    async def health() -> JSONResponse:
        body = {"status": "draining" if state.draining else "ok"}
        if config.api_key is None:  # with a key, /health (which needs none) names nothing
            body["model"] = pool.default.name
        return JSONResponse(body, status_code=503 if state.draining else 200)

    @app.get("/v1/models")
    async def models() -> dict:
        now = fmt.now()
        return {"object": "list", "data": [
            fmt.model_entry(m.name, now, pool.describe(m, now)) for m in pool.models]}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = render_metrics(state.tracker, request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    @app.get("/stats")
    async def stats(model: str | None = None) -> dict:
        client = state.pool.find(model).client  # a model not loaded is not loaded for this: all zeros
        return dataclasses.asdict(client.stats() if client is not None else EngineStats())

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        client = await state.client_for(body.model)
        state.check_prompt_size(body.prompt_parts(), client)
        count = await bounded(state, "tokenizing", partial(client.count_chat_tokens, body.message_dicts(),
                                                           body.add_generation_prompt, body.tool_dicts()))
        return {"count": count, "max_model_len": client.context_length}

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict:
        client = await state.client_for(body.model)
        if client.embedding_pooling() is None:
            raise APIError(400, f"the model {client.model_name!r} does not make embeddings: its checkpoint names no "
                           "pooling (a GGUF's <arch>.pooling_type, a sentence-transformers folder's 1_Pooling)",
                           param="model", code="model_does_not_embed")
        state.check_prompt_size(body.prompt_parts(), client)
        state.admit(1)
        vectors, num_tokens = await _bounded_embed(state, partial(client.embed, body.inputs(), body.normalize))
        return fmt.embedding_list(client.model_name, vectors, num_tokens, body.encoding_format)

    @app.post("/cancel/{response_id}")
    async def cancel(response_id: str) -> dict:
        group = state.groups.get(response_id)
        if group is None:
            raise APIError(404, f"no request {response_id!r} is running", code="not_found")
        group.cancel()
        return {"id": response_id, "cancelled": True}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        client = await state.client_for(body.model)
        state.check(body, client)
        token_text = partial(state.token_text, client=client)
        await state.check_grammars(grammar_checks(body.response_format, body.tools))
        messages = body.message_dicts()
        tools = ToolPlan.for_request(body.tools, body.tool_choice, body.parallel_tool_calls, client.tool_format())

        def start(i: int) -> GenerationStream:  # in a worker thread: the forcing grammar is built here
            return client.chat(messages, tools.apply(state.params(body, i, request)))

        starters = [Starter(i, 0, partial(start, i)) for i in range(body.num_choices)]
        group = await start_group(state, "chat", body.client or "api", body.priority or "interactive", starters)
        constrained = tools.required or (body.response_format or {}).get("type", "text") != "text"
        group.reasoning = ReasoningPlan.for_client(client, body.reasoning_format or config.reasoning_format,
                                                   constrained)
        if body.streaming:
            return event_stream(state, group, chat_events(group, body, client.model_name, token_text, tools))
        results = await collect_unless_gone(state, group, request)
        if results is None:
            return Response(status_code=499)
        num_top = body.top_logprobs or 0
        return JSONResponse(rewrite_completion(fmt.chat_completion(
            group.response_id, fmt.now(), client.model_name, results,
            lambda c: fmt.chat_logprobs(c.logprobs, token_text, num_top) if body.logprobs else None), tools))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        client = await state.client_for(body.model)
        state.check(body, client)
        token_text = partial(state.token_text, client=client)
        await state.check_grammars(grammar_checks(body.response_format, None))
        n = body.num_choices
        starters = [Starter(p * n + j, p, partial(client.complete, prompt, state.params(body, j, request)))
                    for p, prompt in enumerate(body.prompts()) for j in range(n)]
        group = await start_group(state, "completions", body.client or "api", body.priority or "interactive", starters)
        if body.streaming:
            return event_stream(state, group, completion_events(group, body, client.model_name, token_text))
        results = await collect_unless_gone(state, group, request)
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
                c.logprobs, token_text, num_top,
                [o + (len(prompts[c.prompt_index]) if body.echo else 0) for o in c.logprob_offsets])
            if body.logprobs is not None else None))

    return app


async def _bounded_embed(state: ServerState, fn):
    """An embedding runs on the engine's thread; a worker thread tokenises the texts and waits for
    it, counted as waiting meanwhile (--max-queue)."""
    state.num_starting += 1
    try:
        return await asyncio.get_running_loop().run_in_executor(None, fn)
    except RequestError as e:
        raise APIError(400, str(e), param="input") from None
    finally:
        state.num_starting -= 1
