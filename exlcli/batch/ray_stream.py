"""What the Ray pool (ray_pool.py) hands the batch runner: one stream per line, whose result comes
back whole from an actor, and each actor's throughput for the summary."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator

from exlcli.batch.failures import RefusedLine
from exlcli.batch.ray_actor import LineRequest, LineResult
from exlcli.client.base import GenerationStream, TextDelta
from exlcli.errors import ExlcliError


@dataclass
class ActorThroughput:
    """One actor's share of the run, for the summary."""

    index: int
    host: str
    lines: int = 0  # answered, not cancelled (results, error results and refusals)
    completion_tokens: int = 0
    first_sent: float | None = None
    last_answer: float | None = None
    death: str | None = None  # why it left the pool
    handed_back: int = 0  # unfinished lines it left for other actors

    @property
    def busy_s(self) -> float:
        if self.first_sent is None or self.last_answer is None:
            return 0.0
        return max(0.0, self.last_answer - self.first_sent)

    def rates(self) -> str:
        busy = self.busy_s
        return f"{self.completion_tokens / busy:.1f} tok/s, {self.lines / busy:.1f} lines/s" if busy > 0 else "idle"

    def describe(self) -> str:
        text = f"actor {self.index} on {self.host}: {self.lines} lines, {self.completion_tokens} tokens, {self.rates()}"
        if self.death:
            text += f"; died ({self.death}), {self.handed_back} unfinished lines went to the others"
        return text


class RayStream(GenerationStream):
    """One line in the pool. Its result comes whole: one delta with the text and finish reason."""

    def __init__(self, request: LineRequest, on_cancel: Callable[["RayStream"], None]) -> None:
        self.request_id = ""
        self.request = request
        self.attempts = 0
        self.cancelled = False
        self.slot = None  # the pool's record of the actor it was sent to
        self.queued_at = time.monotonic()
        self._on_cancel = on_cancel
        self._done = threading.Event()
        self._result: LineResult | None = None

    def resolve(self, result: LineResult) -> None:
        self._result = result
        self.request_id = result.request_id
        self._done.set()

    def cancel(self) -> None:
        self._on_cancel(self)

    def __iter__(self) -> Iterator[TextDelta]:
        self._done.wait()
        result = self._result
        if result.refused is not None:
            raise RefusedLine(*result.refused)
        if result.failure is not None:
            raise ExlcliError(result.failure)  # the runner leaves it unwritten: a rerun does it
        if result.last is None:
            raise ExlcliError("the stream ended early")
        yield dataclasses.replace(result.last, text=result.text)

    async def __aiter__(self) -> AsyncIterator[TextDelta]:
        for delta in await asyncio.to_thread(list, iter(self)):
            yield delta
