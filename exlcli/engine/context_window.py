"""Past the context window: what a sequence does when its cache would pass its window.

- `stop`: today's behaviour, the request ends with `length` at the context.
- `shift` (llama.cpp's context shift): keep the first `sink_tokens`, drop half of the rest, go on.
- `sinks` (StreamingLLM): keep the `sink_tokens` attention sinks and a rolling window of the most
  recent tokens: each time the cache is full, just enough of the oldest pages after the sinks go.

Whole pages leave the middle of the sequence's block table and go back to the pool (nothing is
copied). Keys are cached rotated (RoPE applied before the write), so the keys of the pages after
the gap are rotated back by the number of tokens dropped (exlcli/model/kv_shift.py): the kept
tokens then sit at positions 0 .. n - 1, exactly as a fresh prefill of them would place them.
Why rotate the cached keys rather than cache them unrotated and rotate at attention time: with
page-sized drops the rotation touches each kept key once per page of new tokens (1/16 of a decode
step's key reads at page size 16), while rotating at attention time redoes it for every key on every
step, in every attention kernel (CPU C, CUDA decode and prefill); measured in scripts/shift_cost.py.

Sink tokens are rounded up to whole pages (4 sinks keep the first page, 16 tokens at page size
16), since only whole pages leave. A shifted sequence's pages after the sinks no longer hold what
their prefix hashes say: they are taken out of the prefix cache before being rotated, a page shared
with another sequence is copied first, and a shifted sequence publishes no further page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from exlcli.engine.page_pool import PagePool
from exlcli.errors import RequestError
from exlcli.model.kv_shift import KeyShift

if TYPE_CHECKING:
    from exlcli.engine.page_groups import PageGroups

OVERFLOW_MODES = ("stop", "shift", "sinks")
DEFAULT_SINK_TOKENS = 4


@dataclass(frozen=True)
class ContextPolicy:
    """A sequence's resolved overflow policy (mode shift or sinks; stop needs none)."""

    mode: str
    sink_tokens: int
    window: int  # most tokens the sequence's cache holds
    page_size: int

    def __post_init__(self) -> None:
        if self.mode not in ("shift", "sinks"):
            raise ValueError(f"no policy object for mode {self.mode!r}")
        if self.window < (self.sink_pages + 2) * self.page_size:
            raise ValueError("the window must hold the sink pages and two more")

    @property
    def sink_pages(self) -> int:
        return -(-self.sink_tokens // self.page_size)

    @property
    def evict_start(self) -> int:
        """Token index where the evicted gap begins: right after the sink pages."""
        return self.sink_pages * self.page_size


def check_mode(mode: str, what: str = "context_overflow") -> str:
    if mode not in OVERFLOW_MODES:
        raise RequestError(f"{what} must be one of {', '.join(OVERFLOW_MODES)}, got {mode!r}")
    return mode


def resolve_policy(mode: str | None, sink_tokens: int | None, window: int | None, *, default_mode: str,
                   default_sink_tokens: int, default_window: int | None, max_model_len: int,
                   page_size: int) -> ContextPolicy | None:
    """The policy of one request (its fields, else the engine's defaults); None for `stop`. A bad
    value is a RequestError naming the field."""
    mode = check_mode(mode if mode is not None else default_mode)
    sinks = sink_tokens if sink_tokens is not None else default_sink_tokens
    size = window if window is not None else (default_window or max_model_len)
    for name, value in (("sink_tokens", sinks), ("window", size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise RequestError(f"{name} must be an integer >= 0, got {value!r}")
    if size > max_model_len:
        raise RequestError(f"window must be at most the context of {max_model_len} tokens, got {size}")
    if mode == "stop":
        return None
    sink_pages = -(-sinks // page_size)
    least = (sink_pages + 2) * page_size
    if size < least:
        raise RequestError(f"window must be at least {least} tokens with sink_tokens {sinks} (the sinks rounded up "
                           f"to pages of {page_size}, and two more pages), got {size}")
    return ContextPolicy(mode, sinks, size, page_size)


def make_room(seq, num_new: int, pool: PagePool, shifts: list[KeyShift], groups: PageGroups | None = None) -> int:
    """Before `seq` computes `num_new` more tokens: if its cache would pass the window, drop whole
    pages after the sinks (bookkeeping here; the key rotation is appended to `shifts`, run by the
    model runner before the step's forward). Returns the tokens it may compute now (fewer than
    asked when even the largest drop leaves no room for them all; 0 when a shared page cannot be
    copied for want of free pages: the sequence waits a step). Every layer group drops the same
    pages (`groups`, engine/page_groups.py; a window group's entries there may be freed already)."""
    policy: ContextPolicy = seq.overflow
    size = policy.page_size
    cached = seq.cache_len
    over = cached + num_new - policy.window
    if over <= 0:
        return num_new
    droppable = cached // size - policy.sink_pages  # full pages after the sinks (the last partial one stays)
    if droppable <= 0:
        return max(0, policy.window - cached)
    want = -(-over // size)
    if policy.mode == "shift":  # llama.cpp: discard half of what is not kept, so shifts are rare
        want = max(want, droppable // 2)
    drop = min(want, droppable)
    first, last = policy.sink_pages, policy.sink_pages + drop
    tables = groups.tables(seq) if groups is not None else [seq.pages]
    shared = [p for table in tables for p in table[last:] if p >= 0 and pool.ref_counts[p] > 1]
    freed = sum(1 for table in tables for p in table[first:last] if p >= 0 and pool.ref_counts[p] == 1)
    if shared and not pool.can_allocate(len(shared) - freed):
        return max(0, min(num_new, policy.window - cached))
    for g, table in enumerate(tables):
        pool.release_all(table[first:last])
        kept = table[last:]
        copies = []
        for i, page in enumerate(kept):
            if page < 0:
                continue  # (freed by a window group: nothing to rotate)
            if pool.ref_counts[page] > 1:  # another sequence reads it as it is: rotate a copy
                fresh = pool.allocate(g)
                copies.append((page, fresh))
                pool.release(page)
                kept[i] = fresh
            else:
                pool.unregister(page)  # its K/V no longer match its prefix hash
        table[first:] = kept
        shifts.append(KeyShift([p for p in kept if p >= 0], -drop * size, copies, group=g))
    seq.num_evicted += drop * size
    return min(num_new, policy.window - seq.cache_len)
