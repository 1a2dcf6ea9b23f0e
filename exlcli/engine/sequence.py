"""A request's life inside the engine: its tokens, pages, progress and timings."""

from __future__ import annotations

import enum
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from exlcli.engine.constraints import TokenConstraint
from exlcli.engine.page_pool import page_hash
from exlcli.engine.request import Request

if TYPE_CHECKING:
    from exlcli.engine.context_window import ContextPolicy


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: Request
    arrival_index: int  # FCFS order within a priority class
    max_tokens: int  # prompt + generation limit (max_new_tokens capped by the context)
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    pages: list[int] = field(default_factory=list)  # group 0's page table (the only one of a one-kind model)
    group_pages: list[list[int]] = field(default_factory=list)  # the other layer groups' (engine/page_groups.py)
    state_slot: int | None = None  # hybrid models: its slot of the per-sequence state (engine/state_pool.py)
    # hybrid models that draft: the slot holding the state after the known tokens of its last verify
    # step, and whether that state goes back into state_slot before its next step (drafts rejected)
    state_backup: int | None = None
    restore_backup: bool = False
    status: SeqStatus = SeqStatus.WAITING
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first admission
    num_preemptions: int = 0
    submit_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Async scheduling: tokens sampled by steps already launched but not yet read back. They count
    # in num_tokens (the scheduler plans around them); the newest len(pending_rows) of them are
    # those rows of the latest step's sampled ids on the device, where the next step's inputs are
    # taken from.
    num_pending: int = 0
    pending_rows: list[int] = field(default_factory=list)
    rng: random.Random = field(default_factory=random.Random)
    constraint: TokenConstraint | None = None  # the request's grammar matcher, at its generated tokens
    spec: object | None = None  # speculative.SpecState once the engine's speculator has seen it
    # Past the window (context_window.py): the policy (None: stop at the context), and how many
    # tokens after the sinks left the cache. Tokens [evict_start, evict_start + num_evicted) are
    # not in the cache; the computed point never lies inside that gap.
    overflow: ContextPolicy | None = None
    num_evicted: int = 0
    evicted_before: int = 0  # of those, evicted before this request resumed its session (engine/sessions.py)
    _hashes: list[int] = field(default_factory=list)
    # the request's class as an int, read several times a step for every sequence (the scheduler's order)
    priority: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.priority = int(self.request.priority)
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_ids)
            self.num_prompt_tokens = len(self.token_ids)
        seed = self.request.sampling.seed
        self.rng = random.Random(seed if seed is not None else random.SystemRandom().getrandbits(64))

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_index)

    @property
    def num_tokens(self) -> int:
        """Known tokens plus those still in flight."""
        return len(self.token_ids) + self.num_pending

    @property
    def limit_reached(self) -> bool:
        """No token may follow the last one (which may still be in flight)."""
        return self.num_tokens >= self.max_tokens

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def evict_start(self) -> int:
        return self.overflow.evict_start if self.overflow is not None else 0

    @property
    def cache_len(self) -> int:
        """Computed tokens that are in the cache (the position the next token is computed at)."""
        computed = self.num_computed_tokens
        return computed - self.num_evicted if self.num_evicted and computed > self.evict_start else computed

    def skip_evicted(self) -> None:
        """Recomputing after a preemption: at the gap, go on after it (its tokens are not recomputed)."""
        if self.num_evicted and self.num_computed_tokens == self.evict_start:
            self.num_computed_tokens += self.num_evicted

    def add_pending(self, rows: list[int]) -> None:
        """The latest step sampled len(rows) tokens for this sequence, at those rows of its ids."""
        self.num_pending += len(rows)
        self.pending_rows = list(rows)

    def pending_read(self, num_tokens: int = 1) -> None:
        """The oldest `num_tokens` pending tokens were read back (appended, or dropped when the
        sequence finished)."""
        if not 0 <= num_tokens <= self.num_pending:
            raise RuntimeError(f"{num_tokens} tokens read back, {self.num_pending} were pending")
        self.num_pending -= num_tokens
        del self.pending_rows[:max(0, len(self.pending_rows) - self.num_pending)]

    def pending_row(self, position: int) -> int:
        """The row of the latest step's sampled ids that holds the pending token at `position`."""
        first = self.num_tokens - len(self.pending_rows)
        if not first <= position < self.num_tokens:
            raise RuntimeError(f"the token at position {position} is not among the latest step's samples")
        return self.pending_rows[position - first]

    def truncate(self, num_tokens: int) -> None:
        """Drop the known tokens from `num_tokens` on (and the page hashes that covered them)."""
        if self.num_pending:
            raise RuntimeError("cannot drop tokens while tokens are in flight")
        if not self.num_prompt_tokens <= num_tokens <= len(self.token_ids):
            raise ValueError(f"cannot truncate {len(self.token_ids)} tokens to {num_tokens} "
                             f"(the prompt has {self.num_prompt_tokens})")
        del self.token_ids[num_tokens:]
        self._hashes.clear()  # recomputed when next asked for (rare: rollbacks that drop tokens)

    def page_hashes(self, num_pages: int, page_size: int) -> list[int]:
        """Hashes of the first `num_pages` pages, which must be full of known tokens."""
        if num_pages * page_size > len(self.token_ids):
            raise ValueError(f"page {num_pages - 1} holds tokens that are not known yet")
        while len(self._hashes) < num_pages:
            i = len(self._hashes)
            parent = self._hashes[-1] if self._hashes else None
            self._hashes.append(page_hash(parent, self.token_ids[i * page_size:(i + 1) * page_size]))
        return self._hashes[:num_pages]
