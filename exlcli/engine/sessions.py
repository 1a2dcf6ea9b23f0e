"""Continuations: a request's cache kept alive after it ends, for the next request of its session.

A request with `session` set does not give its pages back when it finishes: its sequence is parked
under that name (its token ids, pages, computed point and context-shift gap). The next request of
the session resumes it when its prompt starts with the parked tokens: the new sequence takes the
pages and computes only the tokens after the longest common prefix. So a chat turn prefills only
its new message, even after the window has shifted (the prefix cache cannot help there: a shifted
sequence's pages are no longer the prefix they hashed as).

The common prefix may end before the parked tokens do (the chat template spells the previous answer
a little differently from the tokens sampled, or /undo took a turn back): the resumed sequence then
goes back to that point, as a rollback does. Where that point lies in the evicted gap, or the two
requests' window policies differ after a shift, nothing is resumed: the pages go back to the pool
and the request starts afresh (a prompt longer than the window streams through it).

Parked sessions hold pages nobody computes with: the scheduler reclaims them, least recently parked
first, before it would preempt a running sequence or turn a waiting one away.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING

from exlcli.engine.page_groups import FREED, PageGroups, release_table
from exlcli.engine.page_pool import PagePool
from exlcli.engine.sequence import Sequence

if TYPE_CHECKING:
    from exlcli.engine.context_window import ContextPolicy

DEFAULT_MAX_SESSIONS = 16


@dataclass
class ParkedSession:
    token_ids: list[int]
    num_computed_tokens: int  # never past len(token_ids)
    tables: list[list[int]]  # each layer group's pages (engine/page_groups.py)
    num_evicted: int
    overflow: ContextPolicy | None  # the policy the gap was made under


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SessionCache:
    """Parked sequences by session name, least recently parked first (engine thread only)."""

    def __init__(self, pool: PagePool, max_sessions: int = DEFAULT_MAX_SESSIONS,
                 groups: PageGroups | None = None) -> None:
        if max_sessions < 0:
            raise ValueError("max_sessions must be >= 0")
        self.pool = pool
        self.groups = groups or PageGroups([None], pool.page_size)
        self.max_sessions = max_sessions
        self._parked: collections.OrderedDict[str, ParkedSession] = collections.OrderedDict()
        self.num_resumed = 0  # requests that resumed a parked session
        self.num_resumed_tokens = 0  # tokens those did not compute again
        self.num_reclaimed = 0  # sessions whose pages the scheduler took back

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, name: str) -> bool:
        return name in self._parked

    @property
    def num_pages(self) -> int:
        return sum(len(table) - table.count(FREED) for p in self._parked.values() for table in p.tables)

    def park(self, name: str, seq: Sequence, tables: list[list[int]]) -> None:
        """Keep a finished sequence's page `tables` (PageGroups.take: the caller took them) under `name`."""
        self.end(name)
        if not tables[0] or self.max_sessions == 0:
            self._release_tables(tables)
            return
        computed = min(seq.num_computed_tokens, len(seq.token_ids))  # (a dropped in-flight token)
        self._parked[name] = ParkedSession(list(seq.token_ids), computed, tables, seq.num_evicted, seq.overflow)
        while len(self._parked) > self.max_sessions:
            self._release(next(iter(self._parked)))

    def end(self, name: str) -> bool:
        """Give a session's pages back (the conversation ended or was cleared)."""
        if name not in self._parked:
            return False
        self._release(name)
        return True

    def end_all(self) -> None:
        while self._parked:
            self._release(next(iter(self._parked)))

    def reclaim(self, num_pages: int) -> bool:
        """Release parked sessions, oldest first, until `num_pages` can be allocated; True when any was."""
        released = False
        while self._parked and not self.pool.can_allocate(num_pages):
            self._release(next(iter(self._parked)))
            self.num_reclaimed += 1
            released = True
        return released

    def resume(self, name: str, seq: Sequence) -> int:
        """Give `seq` (new, not yet scheduled) the parked cache of session `name` up to the longest
        common prefix of the two token lists; returns the tokens it need not compute (0: nothing
        resumed, and the parked pages went back to the pool)."""
        parked = self._parked.pop(name, None)
        if parked is None:
            return 0
        size = self.pool.page_size
        # at least the last prompt token is computed again: its logits give the first new token
        num_common = common_prefix(parked.token_ids[:parked.num_computed_tokens], seq.token_ids[:-1])
        evicted = parked.num_evicted
        if evicted:
            assert parked.overflow is not None  # tokens leave the cache only under a policy
            gap_end = parked.overflow.evict_start + evicted
            if seq.overflow != parked.overflow or num_common < gap_end:
                self._release_tables(parked.tables)
                return 0
        offset = evicted  # tokens before the computed point that are not in the cache
        cached = num_common - offset
        boundary = cached // size
        seq.pages, seq.group_pages = parked.tables[0], parked.tables[1:]
        if cached % size and self.groups.published_or_shared(self.pool, seq, boundary):
            cached = boundary * size  # never write into a page another reader sees as it is
        if cached + offset == 0:
            self.groups.release_all(self.pool, seq)
            return 0
        self.groups.truncate(self.pool, seq, -(-cached // size))
        # window groups: the pages their windows need from here, taken back from the prefix cache
        # where the parked sequence had let them go (a shifted one's pages hash as nothing)
        hashes = None if evicted else seq.page_hashes(cached // size, size)
        sink_pages = seq.overflow.sink_pages if seq.overflow is not None else 0
        if not self.groups.refill(self.pool, seq, cached, hashes, sink_pages):
            self.groups.release_all(self.pool, seq)
            return 0
        seq.num_computed_tokens = cached + offset
        seq.num_evicted = seq.evicted_before = evicted
        seq.num_cached_tokens = seq.num_computed_tokens
        self.num_resumed += 1
        self.num_resumed_tokens += seq.num_computed_tokens
        return seq.num_computed_tokens

    def _release(self, name: str) -> None:
        self._release_tables(self._parked.pop(name).tables)

    def _release_tables(self, tables: list[list[int]]) -> None:
        for g, table in enumerate(tables):
            release_table(self.pool, table, self.groups.windows[g] is not None)
