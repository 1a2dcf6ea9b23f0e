"""Blocking work on request content (a chat template's render, tokenising, starting a generation)
in a worker thread, a bounded number at once, with a time budget.

A thread cannot be stopped: past its budget the request is answered (OverBudget) while the work
finishes in the background, still holding its slot, so the number running stays bounded; what it
returns then is handed to `late` (a started stream is cancelled there). The byte limits checked
before any work keep such overruns rare; this bounds what is left.
"""

from __future__ import annotations

import asyncio
from typing import Callable, TypeVar

T = TypeVar("T")

DEFAULT_START_BUDGET_MS = 10_000


class OverBudget(Exception):
    def __init__(self, budget_ms: int) -> None:
        super().__init__(f"took longer than the limit of {budget_ms} ms")
        self.budget_ms = budget_ms


async def run_bounded(slots: asyncio.Semaphore, fn: Callable[[], T], budget_ms: int,
                      late: Callable[[T], None] = lambda result: None) -> T:
    """fn() in a thread once a slot is free; OverBudget if it runs past `budget_ms`."""
    await slots.acquire()
    try:
        future = asyncio.get_running_loop().run_in_executor(None, fn)
    except BaseException:
        slots.release()
        raise
    future.add_done_callback(lambda _: slots.release())
    try:
        return await asyncio.wait_for(asyncio.shield(future), budget_ms / 1000)
    except (asyncio.TimeoutError, asyncio.CancelledError) as e:
        # Nobody waits for the result any more (over budget, or the client left).
        future.add_done_callback(lambda f: late(f.result()) if not f.cancelled() and f.exception() is None else None)
        if isinstance(e, asyncio.TimeoutError):
            raise OverBudget(budget_ms) from None
        raise
