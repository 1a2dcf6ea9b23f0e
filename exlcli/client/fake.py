"""A deterministic stand-in for the engine, for tests of the front ends (chat, batch, serve).

It answers a chat with "echo: <last user message>" (and a completion with "echo: <prompt>"),
one word per token, `token_delay` seconds apart. Words count as tokens everywhere, so tests can
reason about lengths exactly.

`fake:replay:FILE` answers with scripted assistant turns instead (ReplayClient), so that a real
agent client can be driven through a task (a tool call, then an answer) with no model.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from typing import AsyncIterator, Iterator

from exlcli.client.base import EngineClient, GenerationParams, GenerationStream, TextDelta, Usage
from exlcli.engine.stats import EngineStats
from exlcli.errors import RequestError

TEMPLATE_TOKENS_PER_MESSAGE = 4


def count_words(text: str) -> int:
    return len(text.split())


class FakeStream(GenerationStream):
    def __init__(self, client: "FakeClient", request_id: str, words: list[str],
                 params: GenerationParams, prompt_tokens: int, sep: str = " ") -> None:
        """`words`: the tokens, joined by `sep` (a replay's tokens carry their own spaces)."""
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._client = client
        self._words = words
        self._sep = sep
        self._params = params
        self._prompt_tokens = prompt_tokens
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    def __iter__(self) -> Iterator[TextDelta]:
        start = time.perf_counter()
        ttft = None
        emitted = ""
        count = 0
        reason = "stop"
        stop_string = None
        self._client._running += 1
        try:
            for i, word in enumerate(self._words):
                delay = self._client.token_delay
                if self._cancelled.wait(delay) if delay else self._cancelled.is_set():
                    reason = "cancelled"
                    break
                if count >= self._params.max_tokens:
                    reason = "length"
                    break
                piece = word if i == 0 else self._sep + word
                candidate = emitted + piece
                hit = [s for s in self._params.stop if s in candidate]
                if hit:
                    stop_string = min(hit, key=candidate.index)
                    cut = candidate.index(stop_string)
                    tail = candidate[len(emitted):cut]
                    if tail:
                        yield TextDelta(text=tail, token_ids=[i])
                    count += 1
                    break
                emitted = candidate
                count += 1
                if ttft is None:
                    ttft = time.perf_counter() - start
                yield TextDelta(text=piece, token_ids=[i])
        finally:
            self._client._running -= 1
        total = time.perf_counter() - start
        self._client.generated_tokens += count
        yield TextDelta(finish_reason=reason, stop_string=stop_string, usage=Usage(
            prompt_tokens=self._prompt_tokens, completion_tokens=count, ttft=ttft,
            total_time=total, decode_tps=(count - 1) / (total - ttft) if ttft and count > 1 and total > ttft else 0.0))

    async def __aiter__(self) -> AsyncIterator[TextDelta]:
        import asyncio  # here: `exlcli run` imports this module (is_fake) and never iterates asynchronously

        iterator = iter(self)
        done = object()
        while True:
            item = await asyncio.to_thread(next, iterator, done)
            if item is done:
                return
            yield item


class FakeClient(EngineClient):
    kind = "local"

    def __init__(self, context_length: int = 2048, token_delay: float = 0.0,
                 model_name: str = "fake-echo") -> None:
        self.model_name = model_name
        self.context_length = context_length
        self.token_delay = token_delay
        self.requests: list[tuple[str, object, GenerationParams]] = []  # (kind, messages|prompt, params)
        self.generated_tokens = 0
        self._running = 0
        self._ids = itertools.count()

    def count_chat_tokens(self, messages: list[dict], add_generation_prompt: bool = True,
                          tools: list[dict] | None = None) -> int:
        """Words of every message's content, 4 per message, 2 for the generation prompt, and the
        words of the tools' JSON."""
        return sum(count_words(m.get("content") or "") + TEMPLATE_TOKENS_PER_MESSAGE for m in messages) + (
            2 if add_generation_prompt else 0) + sum(count_words(json.dumps(t)) for t in tools or [])

    def _start(self, words: list[str], prompt_tokens: int, params: GenerationParams, sep: str = " ") -> FakeStream:
        params.sampling()  # validates, raises RequestError
        if prompt_tokens >= self.context_length:
            raise RequestError(
                f"prompt is {prompt_tokens} tokens, longer than the model's context of {self.context_length}")
        return FakeStream(self, f"fake-{next(self._ids)}", words, params, prompt_tokens, sep)

    def chat(self, messages: list[dict], params: GenerationParams) -> GenerationStream:
        self.requests.append(("chat", [dict(m) for m in messages], params))
        last_user = next((m.get("content", "") for m in reversed(messages) if m.get("role") == "user"), "")
        words = ["echo:"] + last_user.split()
        if params.seed is not None:
            words.append(f"(seed {params.seed})")
        return self._start(words, self.count_chat_tokens(messages, tools=params.tools), params)

    def complete(self, prompt: str, params: GenerationParams) -> GenerationStream:
        self.requests.append(("complete", prompt, params))
        return self._start(["echo:"] + prompt.split(), count_words(prompt), params)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=self._running, pages_total=64, page_size=16,
                           total_generated_tokens=self.generated_tokens)


class ReplayClient(FakeClient):
    """Answers each chat with a scripted assistant turn: turn k for a conversation that already
    holds k assistant messages (the last turn repeats past the end). A turn with a "when" text is
    used instead wherever the conversation's last message contains that text (an agent's side
    requests, such as naming the session). `{tool_result}` in a reply reads as the conversation's
    last tool result, so a client's run shows what it sent back. Its tokens are its words with their
    spaces, so the text comes back exactly (tool calls included)."""

    def __init__(self, turns: list[dict], **kwargs) -> None:
        super().__init__(**kwargs)
        self.turns = [t for t in turns if "when" not in t]
        self.cued = [t for t in turns if "when" in t]
        if not self.turns:
            raise RequestError("a replay needs at least one turn without \"when\"")

    def reply_for(self, messages: list[dict]) -> str:
        last = str(messages[-1].get("content") or "") if messages else ""
        cued = [turn["reply"] for turn in self.cued if turn["when"] in last]
        done = sum(1 for m in messages if m.get("role") == "assistant")
        reply = cued[0] if cued else self.turns[min(done, len(self.turns) - 1)]["reply"]
        if "{tool_result}" in reply:
            result = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "tool"), "")
            reply = reply.replace("{tool_result}", str(result))
        return reply

    def chat(self, messages: list[dict], params: GenerationParams) -> GenerationStream:
        self.requests.append(("chat", [dict(m) for m in messages], params))
        pieces = re.findall(r"\s*\S+|\s+$", self.reply_for(messages))
        return self._start(pieces, self.count_chat_tokens(messages, tools=params.tools), params, sep="")


def read_replay(path: str) -> list[dict]:
    """The turns of a replay file: one JSON object a line, {"reply": TEXT} and maybe "when": TEXT."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except OSError as e:
        raise RequestError(f"cannot read the replay file {path}: {e.strerror or e}") from None
    turns = []
    for n, line in lines:
        try:
            turn = json.loads(line)
        except ValueError as e:
            raise RequestError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(turn, dict) or not isinstance(turn.get("reply"), str) or \
                not isinstance(turn.get("when", ""), str):
            raise RequestError(f"{path}:{n}: each line must be an object with a text \"reply\" "
                               "(and maybe a text \"when\")")
        turns.append(turn)
    return turns


FAKE_PREFIX = "fake:"
REPLAY_CONTEXT = 262_144  # an agent's system prompt and tools alone are tens of thousands of words


def is_fake(model: str | None) -> bool:
    return bool(model) and model.startswith(FAKE_PREFIX)  # type: ignore[union-attr]


def open_fake_client(model: str, default_delay: float = 0.05, default_context: int = 2048) -> FakeClient:
    """`fake:echo[:DELAY[:CONTEXT]]`: the echo engine, DELAY seconds per token, CONTEXT tokens.
    `fake:replay:FILE`: the turns of FILE (ReplayClient), DELAY 0.01."""
    if model.startswith(FAKE_PREFIX + "replay:"):
        path = model[len(FAKE_PREFIX + "replay:"):]
        return ReplayClient(read_replay(path), context_length=REPLAY_CONTEXT, token_delay=0.01, model_name=model)
    parts = model[len(FAKE_PREFIX):].split(":")
    usage = f"bad fake model '{model}'; use fake:echo[:DELAY[:CONTEXT]]"
    if parts[0] != "echo" or len(parts) > 3:
        raise RequestError(f"unknown fake model '{model}'; use fake:echo[:DELAY[:CONTEXT]] or fake:replay:FILE")
    try:
        delay = float(parts[1]) if len(parts) > 1 and parts[1] else default_delay
        context = int(parts[2]) if len(parts) > 2 else default_context
    except ValueError:
        raise RequestError(usage) from None
    if delay < 0 or context < 16:
        raise RequestError(f"bad fake model '{model}': DELAY must be >= 0 and CONTEXT >= 16")
    return FakeClient(context_length=context, token_delay=delay, model_name=model)
