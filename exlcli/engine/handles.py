"""What a caller holds for a submitted request: a `RequestHandle` that yields its deltas, read from
any thread (blocking iteration) or event loop (`async for`), while the engine's thread writes them."""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import AsyncIterator, Iterator, Protocol

from exlcli.engine.request import RequestOutput

_MAX_MERGED_TOKENS = 4096  # an unread delta grows to this many tokens, then a new one starts


class HandleOwner(Protocol):
    """The part of the engine a handle uses."""

    @property
    def is_threaded(self) -> bool: ...

    def step(self) -> bool: ...

    def cancel(self, request_id: str) -> None: ...


class RequestHandle:
    """Deltas of one request; iterate it (blocking) or `async for` it, once."""

    def __init__(self, engine: HandleOwner, request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        self._items: collections.deque[RequestOutput] = collections.deque()
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._blocked_readers = 0  # readers waiting on _cv: the engine notifies only when there are some
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def put(self, out: RequestOutput) -> None:
        """Called by the engine's thread once per token of every sequence: the lock is taken directly,
        and a blocked reader is notified only if there is one. A reader that has not taken the last
        delta yet gets this one merged into it (up to _MAX_MERGED_TOKENS tokens), already signalled,
        so a reader that lags, or reads at the end, holds one delta per request, not one per token:
        at 512 sequences, per-token deltas make each of the garbage collector's full passes cost
        about 130 ms on an H200's host."""
        with self._lock:
            last = self._items[-1] if self._items else None
            if last is not None and not last.finished and len(last.new_token_ids) < _MAX_MERGED_TOKENS:
                last.absorb(out)
                return
            self._items.append(out)
            if self._blocked_readers:
                self._cv.notify_all()
            waiters = list(self._waiters) if self._waiters else None
        for loop, event in waiters or ():
            loop.call_soon_threadsafe(event.set)

    def cancel(self) -> None:
        self._engine.cancel(self.request_id)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            if not self._engine.is_threaded:
                # No engine thread: the reader drives the loop itself (one-shot use, tests).
                while not self._items and self._engine.step():
                    pass
            with self._lock:
                while not self._items:
                    self._blocked_readers += 1
                    try:
                        self._cv.wait()
                    finally:
                        self._blocked_readers -= 1
                out = self._items.popleft()
            yield out
            if out.finished:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        event = asyncio.Event()
        with self._lock:
            self._waiters.append((asyncio.get_running_loop(), event))
        while True:
            event.clear()
            with self._lock:
                out = self._items.popleft() if self._items else None
            if out is None:
                await event.wait()
                continue
            yield out
            if out.finished:
                return
