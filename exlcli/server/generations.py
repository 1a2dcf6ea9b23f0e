"""The engine streams behind one HTTP request (`n` choices, or several prompts): start them,
merge their deltas into one sequence, and cancel them together when the client leaves."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from exlcli.client.base import GenerationStream, TextDelta
from exlcli.engine.request import TokenLogprob
from exlcli.server.bounded_work import run_bounded
from exlcli.server.openai_format import ChoiceResult
from exlcli.server.tracker import Generation, RequestTracker


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


@dataclass
class GenerationGroup:
    response_id: str
    endpoint: str
    client_label: str
    priority: str
    tracker: RequestTracker
    choices: list[Choice] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None  # the request's time limit, cancelled when it ends

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
                if item.delta.finished:
                    item.choice.finished = True
                yield item
        finally:
            for t in tasks:
                t.cancel()
            self.abandon()

    async def collect(self) -> list[ChoiceResult]:
        """Run every choice to its end (non-streaming answers)."""
        results = {c.index: ChoiceResult(index=c.index, prompt_index=c.prompt_index) for c in self.choices}
        texts: dict[int, list[str]] = {c.index: [] for c in self.choices}
        lengths: dict[int, int] = {c.index: 0 for c in self.choices}
        async for item in self.deltas():
            result = results[item.choice.index]
            if item.delta.logprobs:
                new = _as_logprobs(item.delta.logprobs)
                result.logprobs.extend(new)
                result.logprob_offsets.extend([lengths[result.index]] * len(new))
            texts[result.index].append(item.delta.text)
            lengths[result.index] += len(item.delta.text)
            if item.delta.finished:
                result.finish_reason = item.delta.finish_reason
                result.stop_string = item.delta.stop_string
                result.usage = item.delta.usage
                if item.delta.error:
                    raise EngineFailure(item.delta.error)
        for index, parts in texts.items():
            results[index].text = "".join(parts)
        return [results[i] for i in sorted(results)]


class EngineFailure(Exception):
    """The engine failed one of the request's choices."""


def _as_logprobs(items: list) -> list[TokenLogprob]:
    return [t for t in items if isinstance(t, TokenLogprob)]
