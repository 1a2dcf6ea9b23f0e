"""Run one or more generation streams at once and show them one after another.

Each stream is read in its own thread, so K answers from `/n K` are all in flight together (one
engine batch) while the main thread shows the first and buffers the rest. The main thread only
waits on a queue with a short timeout, so Ctrl-C reaches it promptly; it then cancels every
stream and collects what they had produced.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from exlcli.client.base import GenerationStream, TextDelta, Usage

POLL_SECONDS = 0.05
CANCEL_WAIT_SECONDS = 5.0  # how long to wait for cancelled streams to report their end


@dataclass
class Answer:
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    usage: Usage | None = None
    seed: int | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class StreamSet:
    def __init__(self, streams: list[GenerationStream], seeds: list[int | None]) -> None:
        self.streams = streams
        self.answers = [Answer(seed=seed) for seed in seeds]
        self._events: queue.Queue[tuple[int, TextDelta]] = queue.Queue()
        self._threads = [threading.Thread(target=self._pump, args=(i,), daemon=True, name=f"chat-stream-{i}")
                         for i in range(len(streams))]
        for thread in self._threads:
            thread.start()

    def _pump(self, index: int) -> None:
        last: TextDelta | None = None
        try:
            for delta in self.streams[index]:
                last = delta
                self._events.put((index, delta))
                if delta.finished:
                    return
        except Exception as e:  # a broken connection or engine error ends this answer, not the chat
            self._events.put((index, TextDelta(finish_reason="error", error=str(e) or type(e).__name__)))
            return
        if last is None or not last.finished:
            self._events.put((index, TextDelta(finish_reason="stop")))

    def _record(self, index: int, delta: TextDelta) -> None:
        answer = self.answers[index]
        answer.text += delta.text
        if delta.finished:
            answer.finish_reason = delta.finish_reason
            answer.error = delta.error
            answer.usage = delta.usage

    def events(self, on_idle: Callable[[], None] = lambda: None) -> Iterator[tuple[int, TextDelta]]:
        """Deltas as they come, until every stream has finished."""
        while not all(a.done for a in self.answers):
            try:
                index, delta = self._events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                on_idle()
                continue
            self._record(index, delta)
            yield index, delta

    def cancel(self) -> None:
        """Cancel every stream and wait (briefly) for their last deltas; a second Ctrl-C stops waiting."""
        for stream, answer in zip(self.streams, self.answers):
            if not answer.done:
                stream.cancel()
        deadline = time.monotonic() + CANCEL_WAIT_SECONDS
        try:
            while not all(a.done for a in self.answers) and time.monotonic() < deadline:
                try:
                    index, delta = self._events.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    continue
                self._record(index, delta)
        except KeyboardInterrupt:
            pass
        for answer in self.answers:
            if not answer.done:
                answer.finish_reason = "cancelled"
