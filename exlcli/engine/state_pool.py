"""Slot bookkeeping for the per-sequence state of a hybrid model's fixed-state layers (a Gated
DeltaNet's convolution and recurrent state; a Mamba-2 layer's alike): plain Python, no torch.

The device memory is KVCache.states (exlcli/model/state_cache.py), `num_slots` slots of every such
layer's state. A running sequence holds one slot from admission until it finishes, is cancelled or
is preempted (it then recomputes from its prompt: a chunk from position 0 starts from zeros, so a
slot needs no clearing). The scheduler runs at most as many sequences as there are slots, so an
admitted sequence always finds one.

Speculative decoding keeps a second pool of backup slots (`first`: they follow the others in the
state cache): a sequence that drafts holds one, into which each verify step writes the state after
the sequence's known tokens, so that rejected drafts can be un-seen (Scheduler.rollback).
"""

from __future__ import annotations


class OutOfStateSlotsError(RuntimeError):
    pass


class StatePool:
    def __init__(self, num_slots: int, first: int = 0) -> None:
        if num_slots < 1:
            raise ValueError("a state pool needs at least one slot")
        self.num_slots = num_slots
        self.first = first
        self._free = list(range(first + num_slots - 1, first - 1, -1))  # pop() hands out slot `first` first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfStateSlotsError("no free state slots")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"state slot {slot} released but not taken")
        self._used.remove(slot)
        self._free.append(slot)

    def check(self) -> None:
        """Invariants, for tests: every slot is exactly one of free / used."""
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is on the free list twice"
        assert not free & self._used and free | self._used == set(range(self.first, self.first + self.num_slots))


class StateSnapshots:
    """Copies of sequences' states at page boundaries, for the prefix cache: the state after the page
    whose hash (page_pool.page_hash: its tokens and all before them) is the key, in slots
    [first, first + count) of the state cache, least recently used evicted first.

    A snapshot is taken in a step (the model writes the state at that point of the sequence's chunk
    into the slot `take` gives) and becomes visible only when the step is committed (`publish`), so
    no sequence of the same step restores from a slot not yet written; a slot taken by a step that
    never commits goes back at the next `drop_unpublished`."""

    def __init__(self, first: int, count: int) -> None:
        self.first = first
        self.count = count
        self._slot_of: dict[int, int] = {}  # hash -> slot, least recently used first (dicts keep order)
        self._free = list(range(first + count - 1, first - 1, -1))
        self._unpublished: set[int] = set()
        self.num_taken = 0

    def __len__(self) -> int:
        return len(self._slot_of)

    def lookup(self, h: int) -> int | None:
        slot = self._slot_of.pop(h, None)
        if slot is not None:
            self._slot_of[h] = slot  # most recently used
        return slot

    def has(self, h: int) -> bool:
        return h in self._slot_of

    def take(self) -> int | None:
        """A slot to write a new snapshot into (evicting the least recently used), None when every
        slot waits for this step's commit."""
        if not self._free:
            if not self._slot_of:
                return None
            h = next(iter(self._slot_of))
            self._free.append(self._slot_of.pop(h))
        slot = self._free.pop()
        self._unpublished.add(slot)
        return slot

    def publish(self, h: int, slot: int) -> None:
        self._unpublished.discard(slot)
        old = self._slot_of.pop(h, None)
        if old is not None:
            self._free.append(old)
        self._slot_of[h] = slot
        self.num_taken += 1

    def drop_unpublished(self) -> None:
        self._free.extend(self._unpublished)
        self._unpublished.clear()

    def check(self) -> None:
        held = set(self._slot_of.values())
        assert len(held) == len(self._slot_of) and not held & set(self._free) and not held & self._unpublished
        assert held | set(self._free) | self._unpublished == set(range(self.first, self.first + self.count))
