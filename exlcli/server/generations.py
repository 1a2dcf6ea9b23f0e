"""The engine streams behind one HTTP request (`n` choices, or several prompts): start them,
merge their deltas into one sequence, and cancel them together when the client leaves.

Reasoning, for every API module (Chat Completions, Messages, Responses): a group made with a
`ReasoningPlan` (`GenerationGroup(..., reasoning=ReasoningPlan.for_client(client, fmt))`) splits
each choice's text into the model's reasoning and its answer, by the model's own markup
(exlcli.text.reasoning: Qwen3's <think>, gpt-oss's analysis channel):

- streaming: every `ChoiceDelta` from `group.deltas()` carries `.reasoning` and `.content`, the
  parts of its text that are new (a tag split across deltas is held back until it is whole; the
  choice's last delta carries what was held). Send `.content` where the API sends text and
  `.reasoning` where it sends thinking; `.delta.text` is the raw text, markup included.
- whole answers: `group.collect()` gives `ChoiceResult`s whose `.text` is the answer and whose
  `.reasoning` is the reasoning (None when the model wrote none).

Without a plan (or with `--reasoning-format none`, `ReasoningPlan(None)`) `.content` is the raw
text and `.reasoning` is empty / None: the reasoning stays inline, as the model wrote it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from exlcli.client.base import GenerationStream, TextDelta
from exlcli.engine.request import TokenLogprob
from exlcli.server.bounded_work import run_bounded
from exlcli.server.openai_format import ChoiceResult
from exlcli.server.tracker import Generation, RequestTracker
from exlcli.text.reasoning import ReasoningSplitter, reasoning_splitter

REASONING_FORMATS = ("auto", "none")  # --reasoning-format: auto separates it, none leaves it inline


@dataclass(frozen=True)
class ReasoningPlan:
    """How a request's answers are split: `syntax` is the model's reasoning markup (None: kept
    inline); `constrained`: a grammar shapes the answer from its first token (a forced tool call,
    a response_format), so it never starts inside a reasoning block the prompt opened."""

    syntax: str | None = None
    constrained: bool = False

    @classmethod
    def for_client(cls, client: object, reasoning_format: str | None, constrained: bool = False) -> "ReasoningPlan":
        """The plan for a model served by `client` under `reasoning_format` (auto or none)."""
        if reasoning_format == "none":
            return cls(None)
        syntax_of = getattr(client, "reasoning_syntax", None)
        return cls(syntax_of() if callable(syntax_of) else None, constrained)

    def splitter(self, stream: GenerationStream) -> ReasoningSplitter:
        opened = bool(getattr(stream, "reasoning_open", False)) and not self.constrained
        return reasoning_splitter(self.syntax, opened)


@dataclass
class Choice:
    index: int  # the choice's index in the response
    prompt_index: int
    stream: GenerationStream
    gen: Generation
    finished: bool = False


@dataclass
class Starter:
    """How to start one choice: a blocking call returning a GenerationStream."""

    index: int
    prompt_index: int
    start: Callable[[], GenerationStream]


@dataclass
class ChoiceDelta:
    choice: Choice
    delta: TextDelta
    reasoning: str = ""  # the new reasoning text (see the module's docstring)
    content: str = ""  # the new answer text


@dataclass
class GenerationGroup:
    response_id: str
    endpoint: str
    client_label: str
    priority: str
    tracker: RequestTracker
    choices: list[Choice] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None  # the request's time limit, cancelled when it ends
    reasoning: ReasoningPlan = field(default_factory=ReasoningPlan)  # how answers split (none: inline)

    async def start(self, starters: list[Starter], tokenizing: asyncio.Semaphore, budget_ms: int) -> None:
        """Start every choice; if one is refused (RequestError, or OverBudget past `budget_ms`)
        cancel those already started."""
        try:
            for s in starters:
                # Off the event loop, and a few at a time: starting renders the template and
                # tokenises the prompt, which can take a while and a lot of memory. A stream that
                # starts after its request gave up is cancelled at once.
                stream = await run_bounded(tokenizing, s.start, budget_ms, late=lambda late: late.cancel())
                gen = self.tracker.start(stream.request_id, self.client_label, self.priority, self.endpoint,
                                         self.response_id, s.index if len(starters) > 1 else None)
                self.choices.append(Choice(s.index, s.prompt_index, stream, gen))
        except BaseException:
            self.abandon()
            raise

    def cancel(self) -> None:
        """Ask the engine to stop every unfinished choice; each stream then ends with a final
        'cancelled' delta, which a client still listening receives."""
        for c in self.choices:
            if not c.finished:
                c.stream.cancel()

    def abandon(self) -> None:
        """Nobody will read the rest: cancel what is unfinished and record it as cancelled now."""
        if self.timer is not None:
            self.timer.cancel()
        for c in self.choices:
            if not c.finished:
                c.stream.cancel()
                c.finished = True
                self.tracker.finish(c.gen, None, "cancelled")

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Deltas of all choices, interleaved as they come; closing this cancels what is left."""
        queue: asyncio.Queue[ChoiceDelta | Choice] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for delta in choice.stream:
                    await queue.put(ChoiceDelta(choice, delta))
                    if delta.finished:
                        return
                # The stream ended without a final delta: treat as an engine error.
                await queue.put(ChoiceDelta(choice, TextDelta(finish_reason="error",
                                                              error="the engine ended the stream early")))
            except Exception as e:  # an engine failure ends this choice, not the server
                await queue.put(ChoiceDelta(choice, TextDelta(finish_reason="error", error=f"engine error: {e}")))
            finally:
                await queue.put(choice)

        tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        splitters = {c.index: self.reasoning.splitter(c.stream) for c in self.choices}
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, Choice):
                    remaining -= 1
                    continue
                if item.choice.finished:
                    continue
                self.tracker.on_delta(item.choice.gen, item.delta)
                splitter = splitters[item.choice.index]
                item.reasoning, item.content = splitter.feed(item.delta.text)
                if item.delta.finished:
                    item.choice.finished = True
                    reasoning, content = splitter.finish()
                    item.reasoning += reasoning
                    item.content += content
                yield item
        finally:
            for t in tasks:
                t.cancel()
            self.abandon()

    async def collect(self) -> list[ChoiceResult]:
        """Run every choice to its end (non-streaming answers)."""
        results = {c.index: ChoiceResult(index=c.index, prompt_index=c.prompt_index) for c in self.choices}
        texts: dict[int, list[str]] = {c.index: [] for c in self.choices}
        thoughts: dict[int, list[str]] = {c.index: [] for c in self.choices}
        lengths: dict[int, int] = {c.index: 0 for c in self.choices}
        async for item in self.deltas():
            result = results[item.choice.index]
            if item.delta.logprobs:
                new = _as_logprobs(item.delta.logprobs)
                result.logprobs.extend(new)
                result.logprob_offsets.extend([lengths[result.index]] * len(new))
            texts[result.index].append(item.content)
            thoughts[result.index].append(item.reasoning)
            lengths[result.index] += len(item.content)
            if item.delta.finished:
                result.finish_reason = item.delta.finish_reason
                result.stop_string = item.delta.stop_string
                result.usage = item.delta.usage
                if item.delta.error:
                    raise EngineFailure(item.delta.error, item.delta.error_code)
        for index, parts in texts.items():
            results[index].text = "".join(parts)
            if self.reasoning.syntax is not None and (thought := "".join(thoughts[index])):
                results[index].reasoning = thought
        return [results[i] for i in sorted(results)]


class EngineFailure(Exception):
    """The engine failed one of the request's choices (`code` "grammar_mismatch": the request's
    grammar refused a token the model wrote, a 400, not the server's fault)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code

    def api_status(self) -> tuple[int, str]:
        """The HTTP status and error type the failure is answered with."""
        return (400, "invalid_request_error") if self.code == GRAMMAR_MISMATCH else (500, "server_error")


GRAMMAR_MISMATCH = "grammar_mismatch"


def _as_logprobs(items: list) -> list[TokenLogprob]:
    return [t for t in items if isinstance(t, TokenLogprob)]
