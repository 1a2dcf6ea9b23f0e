"""The one interface every front end (chat, batch, bench, serve) talks to.

`LocalClient` runs the engine in this process; `RemoteClient` (exlcli.client.remote) talks to a
running `exlcli serve`. Both speak text and chat messages; tokenisation happens behind them.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

from exlcli.engine.request import GrammarSpec, Priority
from exlcli.engine.sampling import SAMPLING_PARAMS, SamplingParams
from exlcli.engine.stats import EngineStats
from exlcli.errors import RequestError
from exlcli.text.tool_formats import HermesFormat, ToolFormat


@dataclass
class GenerationParams(SamplingParams):
    """One generation as a front end asks for it: the sampling parameters (checked when made, see
    exlcli.engine.sampling) and what goes around them."""

    temperature: float = 0.7  # front ends start a little cooler than the engine's neutral 1.0
    max_tokens: int = 512
    stop: list[str] = field(default_factory=list)
    priority: str = "interactive"  # or "batch"
    client: str = "api"  # chat / batch / bench / api, for the live display
    grammar: GrammarSpec | None = None  # structured output (JSON schema, regex, grammar)
    speculative: bool | None = None  # False: no speculative decoding for this request (None: the engine's)
    tools: list[dict] | None = None  # OpenAI tool objects the chat template describes to the model
    context_overflow: str | None = None  # past the window: stop / shift / sinks (None: the engine's)
    sink_tokens: int | None = None
    window: int | None = None
    # a continuation: the engine keeps this request's cache for the session's next request, which
    # then computes only its new tokens (engine/sessions.py); chat sets one per conversation
    session: str | None = None

    def sampling(self) -> SamplingParams:
        """The engine's part, checked again (a field may have been set since these were made)."""
        return SamplingParams(**{p.name: getattr(self, p.name) for p in SAMPLING_PARAMS})

    def priority_class(self) -> Priority:
        return Priority.parse(self.priority)


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_time: float = 0.0
    ttft: float | None = None
    total_time: float = 0.0
    decode_tps: float = 0.0
    evicted_tokens: int = 0  # tokens that left the cache by context shifts


@dataclass
class TextDelta:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # stop / length / cancelled / error, on the last delta
    error: str | None = None
    usage: Usage | None = None  # on the last delta
    logprobs: list | None = None  # list[exlcli.engine.request.TokenLogprob] when asked for
    stop_string: str | None = None  # on the last delta: the stop string that ended the text, if one did
    # with finish_reason "error": the transport to the engine broke (a server stream cut off), not the
    # request; the same request may well succeed when asked again (batch leaves the line for a rerun)
    lost: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class GenerationStream(abc.ABC):
    """Deltas of one generation, as a blocking or an async iterator (use one of the two)."""

    request_id: str
    prompt_tokens: int | None = None  # the prompt's tokens, where known when the stream starts

    @abc.abstractmethod
    def __iter__(self) -> Iterator[TextDelta]: ...

    @abc.abstractmethod
    def __aiter__(self) -> AsyncIterator[TextDelta]: ...

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop generating; the stream then ends with finish_reason 'cancelled'."""

    def collect(self) -> tuple[str, TextDelta]:
        """Run to the end; return the whole text and the last delta (finish reason, usage)."""
        parts: list[str] = []
        last = TextDelta()
        for delta in self:
            parts.append(delta.text)
            last = delta
        return "".join(parts), last


class EngineClient(abc.ABC):
    kind: str  # "local" or "remote"
    model_name: str
    context_length: int

    @abc.abstractmethod
    def chat(self, messages: list[dict], params: GenerationParams) -> GenerationStream:
        """Start a chat completion. Raises exlcli.errors.RequestError for a request that can't run
        (bad parameters, prompt longer than the context)."""

    @abc.abstractmethod
    def complete(self, prompt: str, params: GenerationParams) -> GenerationStream:
        """Start a raw completion of `prompt` (no chat template)."""

    @abc.abstractmethod
    def count_chat_tokens(self, messages: list[dict], add_generation_prompt: bool = True,
                          tools: list[dict] | None = None) -> int:
        """Prompt tokens that `chat(messages)` would use (with `tools` described to the model)."""

    @abc.abstractmethod
    def stats(self) -> EngineStats: ...

    def end_session(self, session: str) -> None:
        """The conversation `session` is over: the engine may free the cache it kept for it."""

    def num_requests(self) -> int:
        """Requests submitted and not finished (a server never unloads a model that has some)."""
        stats = self.stats()
        return stats.num_running + stats.num_waiting

    def memory_bytes(self) -> int:
        """Bytes the engine holds (weights and KV cache; 0 where nothing is held in this process)."""
        return 0

    def embedding_pooling(self) -> str | None:
        """How the model pools an embedding ("mean", "last" or "cls"), None when it does not embed."""
        return None

    def embed(self, inputs: list[list[int]] | list[str],
              normalize: bool | None = None) -> tuple[list[list[float]], int]:
        """One vector per input (text or token ids), pooled as embedding_pooling() says (normalize None:
        the checkpoint's default); returns the
        vectors and the tokens they took. Raises RequestError for a model that does not embed."""
        raise RequestError(f"the model {self.model_name!r} does not make embeddings")

    def tool_format(self) -> ToolFormat:
        """How the model spells tool calls (the chat template's format; hermes when it has none)."""
        return HermesFormat()

    def close(self) -> None:
        pass

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
