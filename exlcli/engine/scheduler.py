"""One rule for prefill and decode: each running sequence's computed tokens catch up to its known
tokens under a per-step token budget. Interactive before batch, first come first served within a
class; when pages run out, the lowest-priority most recent sequence is preempted (its pages freed,
recomputed later, its full pages kept in the prefix cache). `rollback` un-computes tokens (rejected
drafted tokens) and returns the pages they took."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable

from exlcli.engine.context_window import make_room
from exlcli.engine.page_groups import PageGroups
from exlcli.engine.page_pool import PagePool
from exlcli.engine.sequence import SeqStatus, Sequence
from exlcli.engine.state_pool import StatePool, StateSnapshots
from exlcli.model.kv_shift import KeyShift


@dataclass
class ScheduledSeq:
    """One sequence's part of a step: `num_new_tokens` tokens from seq.num_computed_tokens on, the
    last len(draft_tokens) of them drafted tokens to verify (they follow the known and pending
    tokens), and the next-token logits wanted at its last `num_logits` positions."""

    seq: Sequence
    num_new_tokens: int
    # None: 1 + len(draft_tokens) when the chunk reaches the last token (each drafted token is
    # checked by the logits before it, and the last one gives the next token), else 0 (mid-prompt)
    num_logits: int | None = None
    draft_tokens: list[int] = field(default_factory=list)
    # hybrid models: the state slot restored into the sequence's own before the step (a prefix-cache
    # hit's snapshot), and (tokens into the chunk, slot, page hash) of a snapshot taken in the step
    restore: int | None = None
    snapshot: tuple[int, int, int] | None = None
    # hybrid models verifying drafts: (tokens into the chunk, slot) of the state after its known
    # tokens, kept in the sequence's backup slot in case drafts are rejected (rollback)
    backup: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.num_new_tokens < 1:
            raise ValueError("a scheduled sequence must compute at least one token")
        end = self.seq.num_computed_tokens + self.num_new_tokens
        total = self.seq.num_tokens + len(self.draft_tokens)
        if end > total:
            raise ValueError(f"the chunk ends at token {end}, past the {total} known, pending and drafted ones")
        if self.draft_tokens and (end != total or self.num_new_tokens <= len(self.draft_tokens)):
            raise ValueError("drafted tokens must end the chunk, after at least one known or pending token")
        if self.num_logits is None:
            self.num_logits = 1 + len(self.draft_tokens) if end == total else 0
        if not 0 <= self.num_logits <= self.num_new_tokens:
            raise ValueError(f"{self.num_logits} logits rows wanted from a chunk of {self.num_new_tokens} tokens")

    @property
    def samples(self) -> bool:
        """The step yields next-token logits for this sequence."""
        assert self.num_logits is not None  # __post_init__ sets it
        return self.num_logits > 0


@dataclass
class ScheduledBatch:
    items: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    key_shifts: list[KeyShift] = field(default_factory=list)  # context shifts to apply before the forward

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.items)


class Scheduler:
    def __init__(self, pool: PagePool, max_num_batched_tokens: int, max_num_seqs: int,
                 propose: Callable[[Sequence, int], list[int]] | None = None,
                 reclaim: Callable[[int], bool] | None = None, states: StatePool | None = None,
                 snapshots: StateSnapshots | None = None, groups: PageGroups | None = None,
                 backups: StatePool | None = None) -> None:
        self.pool = pool
        # the layer groups' page tables (one group of every layer unless the model mixes attention kinds)
        self.groups = groups or PageGroups([None], pool.page_size)
        # hybrid models: one state slot a running sequence, so no more sequences run than there are slots
        self.states = states
        if states is not None:
            max_num_seqs = min(max_num_seqs, states.num_slots)
        # hybrid models with prefix caching: states at page boundaries, so a prefix hit resumes there
        self.snapshots = snapshots
        # hybrid models with speculative decoding: a backup slot for each sequence that drafts
        self.backups = backups
        # reclaim(num_pages) frees pages held outside the running set (parked sessions) until
        # num_pages can be allocated; True when it freed any
        self.reclaim = reclaim
        # speculative decoding: propose(seq, max_tokens) drafts tokens to verify after seq's last one
        self.propose = propose
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.background_chunk = max(16, max_num_batched_tokens // 8)
        self._background_left = self.background_chunk
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self.num_preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished, cancelled or failed) and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.groups.release_all(self.pool, seq)
        self._release_state(seq)
        seq.status = SeqStatus.FINISHED

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Class by class (interactive first): the running sequences of a class get their
        chunks, then waiting ones of that class are admitted, then the next class gets what is
        left of the budget. So a new chat is never queued behind a batch job's prefill."""
        batch = ScheduledBatch()
        if self.snapshots is not None:
            self.snapshots.drop_unpublished()  # (taken by a step that failed before its commit)
        self._make_room_for_priority(batch)
        budget = self.max_num_batched_tokens
        top = min((s.priority for s in self.running + self.waiting[:1]), default=0)
        in_flight: set[int] = set()  # hashes of pages that this step completes
        self._background_left = self.background_chunk
        for cls in sorted({s.priority for s in self.running + self.waiting}):
            for seq in [s for s in self.running if s.priority == cls]:
                if budget <= 0:
                    break
                if seq.status is not SeqStatus.RUNNING:
                    continue  # preempted by a sequence scheduled before it
                if seq.limit_reached:
                    continue  # its last token is still in flight (async scheduling)
                n = self._chunk(seq, budget, top, batch)
                if n == 0:
                    continue
                if not self._reserve(seq, n, batch):
                    break  # seq itself was preempted; it was the last one
                drafts = self._drafts(seq, n, budget - n)
                # (rejected drafts last step: the state after the known tokens goes back first)
                restore = seq.state_backup if seq.restore_backup else None
                backup = (n, seq.state_backup) if drafts and seq.state_backup is not None else None
                batch.items.append(ScheduledSeq(seq, n + len(drafts), draft_tokens=drafts, restore=restore,
                                                backup=backup))
                self._plan_snapshot(batch.items[-1])
                budget -= n + len(drafts)
                if self.pool.enable_prefix_cache:
                    in_flight |= self._future_full_pages(seq, n)
            budget = self._admit(cls, budget, top, batch, in_flight)
        return batch

    def schedule_alone(self, seq: Sequence) -> ScheduledBatch:
        """Plans a step for `seq` alone, to find out which sequence makes scheduling fail: the others
        keep their places, pages and progress (none is preempted for it), and `seq` is admitted only
        to a slot the running set has free."""
        running, waiting = self.running, self.waiting
        others = len(running) - (seq in running)
        self.running, self.waiting = [s for s in running if s is seq], [s for s in waiting if s is seq]
        max_num_seqs, self.max_num_seqs = self.max_num_seqs, self.max_num_seqs - others
        try:
            return self.schedule()
        finally:
            self.max_num_seqs = max_num_seqs
            self.running = sorted([s for s in running if s is not seq] + self.running, key=lambda s: s.sort_key)
            self.waiting = sorted([s for s in waiting if s is not seq] + self.waiting, key=lambda s: s.sort_key)

    def _admit(self, cls: int, budget: int, top: int, batch: ScheduledBatch, in_flight: set[int]) -> int:
        """Move waiting sequences of class `cls` into the running set while budget, sequence
        slots and pages allow; returns the budget left."""
        w = 0
        while w < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[w]
            if seq.priority != cls or seq.num_pending:
                w += 1  # (preempted with a token in flight: it waits until the token is read)
                continue
            restore = self._match_prefix(seq)
            if self._next_page_in_flight(seq, in_flight):
                # Another sequence is computing this very page now: wait one step and share it
                # instead of computing a second copy.
                self._unmatch(seq)
                w += 1
                continue
            n = self._chunk(seq, budget, top, batch)
            if n == 0:
                self._unmatch(seq)
                break
            needed = self._pages_needed(seq, n)
            if not self._can_allocate(needed):
                self._unmatch(seq)
                break
            self.waiting.pop(w)
            self._allocate(seq, needed)
            if self.states is not None:  # (running < max_num_seqs <= slots: one is free)
                seq.state_slot = self.states.allocate()
            if self.pool.enable_prefix_cache:
                in_flight |= self._future_full_pages(seq, n)
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)  # running[-1] stays the lowest
            batch.items.append(ScheduledSeq(seq, n, restore=restore))
            self._plan_snapshot(batch.items[-1])
            budget -= n
        return budget

    def commit(self, batch: ScheduledBatch) -> None:
        """After the forward pass is queued: advance progress and publish newly full pages to the
        cache (a page whose last token is still in flight is published when that token is read,
        by `token_known`)."""
        size = self.page_size
        for item in batch.items:
            seq = item.seq
            if item.snapshot is not None and self.snapshots is not None:
                self.snapshots.publish(item.snapshot[2], item.snapshot[1])
            if seq.restore_backup and item.restore == seq.state_backup:
                seq.restore_backup = False  # the copy is queued before this step's forward pass
            before = seq.num_computed_tokens // size
            seq.num_computed_tokens += item.num_new_tokens
            seq.skip_evicted()
            after = min(seq.num_computed_tokens, len(seq.token_ids)) // size
            if after > before and not seq.num_evicted:  # a shifted sequence publishes nothing
                hashes = seq.page_hashes(after, size)
                for p in range(before, after):
                    self.groups.register(self.pool, seq, p, hashes[p])

    def token_known(self, seq: Sequence) -> None:
        """A token in flight was read and appended: publish its page if that token filled a page
        that is already computed."""
        n = len(seq.token_ids)
        if n % self.page_size == 0 and seq.num_computed_tokens >= n and seq.pages and not seq.num_evicted:
            p = n // self.page_size - 1
            self.groups.register(self.pool, seq, p, seq.page_hashes(p + 1, self.page_size)[p])

    def rollback(self, seq: Sequence, num_tokens: int, num_dropped: int = 0) -> int:
        """Un-compute the last `num_tokens` computed tokens of a running sequence (rejected drafted
        tokens, say) and drop its last `num_dropped` known tokens, which must lie past the new
        computed point with at least one known token left to compute. Pages no longer needed go
        back to the pool; a published full page keeps its hash, since its K/V still match it.

        Never writes into a page that is published or shared: when the new computed point falls
        inside such a page, the sequence lets go of it and goes back to the page's start (it gets
        a fresh page and recomputes those few tokens). Returns the tokens actually un-computed.

        After a step that verified drafted tokens, roll the rejected ones back before appending the
        accepted and the next token: `token_known` publishes a page filled by an appended token
        only when that position is computed, and a rejected draft's K/V must not count as such."""
        if seq.status is not SeqStatus.RUNNING:
            raise ValueError(f"{seq.request_id} is not running")
        if seq.state_slot is not None and num_tokens:
            # A recurrent state cannot un-see tokens: it goes back to the backup taken after the known
            # tokens, so every drafted token is un-computed (the accepted ones are computed again).
            if seq.state_backup is None or num_dropped:
                raise ValueError(f"{seq.request_id} keeps a linear attention state, which rolls back only "
                                 "to its backup after the known tokens")
            num_tokens = seq.num_computed_tokens - len(seq.token_ids)
            seq.restore_backup = True
        if not 0 <= num_tokens <= seq.num_computed_tokens or num_dropped < 0:
            raise ValueError(f"cannot roll back {num_tokens} of {seq.num_computed_tokens} computed tokens "
                             f"dropping {num_dropped}")
        computed = seq.num_computed_tokens - num_tokens
        if num_dropped:
            kept = len(seq.token_ids) - num_dropped
            if kept <= computed:
                raise ValueError(f"dropping {num_dropped} tokens leaves {kept}, nothing to compute after the "
                                 f"{computed} still computed")
            seq.truncate(kept)
        size = self.page_size
        offset = seq.num_computed_tokens - seq.cache_len  # tokens evicted before the computed point
        cached = computed - offset  # (drafted tokens never reach back into the evicted gap)
        boundary = cached // size
        if cached % size and self.groups.published_or_shared(self.pool, seq, boundary):
            cached = boundary * size
        self.groups.truncate(self.pool, seq, -(-cached // size))
        undone = seq.num_computed_tokens - (cached + offset)
        if seq.restore_backup and undone != num_tokens:  # (drafts never fill a page, so none is published)
            raise RuntimeError(f"{seq.request_id}: its state cannot go back past its backup")
        seq.num_computed_tokens = cached + offset
        return undone

    def _release_state(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            assert self.states is not None  # only a state pool hands out slots
            self.states.release(seq.state_slot)
            seq.state_slot = None
        if seq.state_backup is not None:
            assert self.backups is not None  # only the backup pool hands out backups
            self.backups.release(seq.state_backup)
            seq.state_backup = None
        seq.restore_backup = False

    # -- helpers --------------------------------------------------------------------------------
    def _drafts(self, seq: Sequence, n: int, budget: int) -> list[int]:
        """Drafted tokens to verify after a chunk that reaches seq's last token, with their pages
        reserved; none when they would not fit the budget, the generation limit or the free pages
        (drafts never preempt anyone)."""
        if self.propose is None or seq.num_computed_tokens + n != seq.num_tokens:
            return []
        if seq.state_slot is not None and seq.state_backup is None:  # a hybrid model's: a backup first
            if self.backups is None or not self.backups.num_free:
                return []
            seq.state_backup = self.backups.allocate()
        room = min(budget, seq.max_tokens - seq.num_tokens - 1)  # every accepted draft plus one more token fits
        if seq.overflow is not None:  # never drafts across a context shift: the next step shifts first
            room = min(room, seq.overflow.window - seq.cache_len - n)
        drafts = self.propose(seq, room)[:max(0, room)] if room > 0 else []
        if not drafts:
            return []
        needed = self._pages_needed(seq, n + len(drafts))
        if not self.pool.can_allocate(needed):
            return []
        self._allocate(seq, needed)
        return drafts

    def _chunk(self, seq: Sequence, budget: int, top_priority: int, batch: ScheduledBatch) -> int:
        """Tokens `seq` computes this step (0: none). While a higher class has work, the lower
        classes' prefills share `background_chunk` tokens a step, so the step (and the higher
        class's inter-token gap) stays short; their decode tokens are not held back. A sequence
        with an overflow policy makes room in its window first (context_window.make_room)."""
        seq.skip_evicted()
        self.groups.slide(self.pool, seq)  # window groups give back what no window reaches any more
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if seq.num_evicted and seq.num_computed_tokens < seq.evict_start < seq.num_computed_tokens + n:
            n = seq.evict_start - seq.num_computed_tokens  # recomputing: the sinks, then the kept tokens
        if n > 1 and seq.priority > top_priority:
            n = min(n, self._background_left)
            self._background_left -= n
        if seq.overflow is not None and n > 0:
            n = make_room(seq, n, self.pool, batch.key_shifts, self.groups)
        return n

    def _future_full_pages(self, seq: Sequence, n: int) -> set[int]:
        """Hashes of the full pages that computing `n` more tokens of `seq` completes."""
        if seq.num_evicted:
            return set()
        size = self.page_size
        first = seq.num_computed_tokens // size
        last = min(seq.num_computed_tokens + n, len(seq.token_ids)) // size
        return set(seq.page_hashes(last, size)[first:]) if last > first else set()

    def _next_page_in_flight(self, seq: Sequence, in_flight: set[int]) -> bool:
        if not in_flight or seq.num_evicted:
            return False
        max_pages = (seq.num_tokens - 1) // self.page_size
        matched = len(seq.pages)
        return matched < max_pages and seq.page_hashes(max_pages, self.page_size)[matched] in in_flight

    def _pages_needed(self, seq: Sequence, n: int) -> int:
        """Pages of every group together that `n` more tokens of `seq` take."""
        return self.groups.pages_needed(seq, seq.cache_len + n)

    def _allocate(self, seq: Sequence, num_pages: int) -> None:
        self.groups.allocate(self.pool, seq, num_pages // self.groups.num_groups)

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Pages for `n` more tokens of a running seq, preempting from the back of the running
        list as needed. False if `seq` itself had to go."""
        needed = self._pages_needed(seq, n)
        while needed and not self._can_allocate(needed):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
            needed = self._pages_needed(seq, n)
        self._allocate(seq, needed)
        return True

    def _can_allocate(self, num_pages: int) -> bool:
        return self.pool.can_allocate(num_pages) or (self.reclaim is not None and self.reclaim(num_pages)
                                                      and self.pool.can_allocate(num_pages))

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.groups.release_all(self.pool, seq)
        self._release_state(seq)  # recomputed from the prompt, from a zero state
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(seq)
        self.add(seq)

    def _make_room_for_priority(self, batch: ScheduledBatch) -> None:
        """A waiting request of a higher class displaces running lower-class ones when the
        running set is full or the pool cannot take its first chunk."""
        if not self.waiting:
            return
        head = self.waiting[0]
        while self.running and self.running[-1].priority > head.priority:
            first_chunk = min(head.num_tokens, self.max_num_batched_tokens)
            full = len(self.running) >= self.max_num_seqs
            if not full and self._can_allocate(-(-first_chunk // self.page_size) * self.groups.num_groups):
                return
            self._preempt(self.running[-1], batch)

    def _plan_snapshot(self, item: ScheduledSeq) -> None:
        """Hybrid models: where `item`'s chunk reaches the end of a page whose tokens are all known,
        take a snapshot of the state there (the last such page of the chunk), unless one is kept."""
        seq = item.seq
        if self.snapshots is None or seq.num_evicted or item.draft_tokens:
            return
        size = self.page_size
        begin = seq.num_computed_tokens
        boundary = min(begin + item.num_new_tokens, len(seq.token_ids)) // size * size
        if boundary <= begin:
            return
        h = seq.page_hashes(boundary // size, size)[-1]
        if self.snapshots.has(h):
            return
        slot = self.snapshots.take()
        if slot is not None:
            item.snapshot = (boundary - begin, slot, h)

    def _match_prefix(self, seq: Sequence) -> int | None:
        """Reuse every leading full page already in the pool (never the last token: at least
        one token must be computed to get the next-token logits). A hybrid model's sequence keeps
        them up to the last page after which a snapshot of the state is kept, and returns that
        snapshot's slot (restored into its own before the step); None: nothing to restore."""
        if seq.pages or seq.num_computed_tokens or seq.num_evicted:
            return None  # (a shifted sequence's kept tokens are no prefix of anything cached)
        size = self.page_size
        max_pages = (seq.num_tokens - 1) // size
        if seq.overflow is not None:  # a prompt longer than the window: the rest goes through it
            max_pages = min(max_pages, seq.overflow.window // size - 1)
        first_time = seq.first_scheduled_time is None and seq.num_preemptions == 0
        if first_time:
            self.prefix_queries += seq.num_tokens
        if not self.pool.enable_prefix_cache or max_pages == 0:
            return None
        hashes = seq.page_hashes(max_pages, size)
        sink_pages = seq.overflow.sink_pages if seq.overflow is not None else 0
        matched = self.groups.match(self.pool, seq, hashes, sink_pages)
        restore = None
        if self.states is not None:  # a state only where a snapshot was kept: back to the last such page
            while matched and (restore := self.snapshots.lookup(hashes[matched - 1])
                               if self.snapshots else None) is None:
                matched -= 1
            self.groups.truncate(self.pool, seq, matched)
        seq.num_computed_tokens = matched * size
        if first_time:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_hits += seq.num_computed_tokens
        return restore

    def _unmatch(self, seq: Sequence) -> None:
        if seq.first_scheduled_time is None and seq.num_preemptions == 0:
            self.prefix_queries -= seq.num_tokens
            self.prefix_hits -= seq.num_cached_tokens
            seq.num_cached_tokens = 0
            seq.num_evicted = seq.evicted_before = 0  # a resumed session (engine/sessions.py) starts afresh
        self.groups.release_all(self.pool, seq)
        seq.num_computed_tokens = 0
