"""Slot bookkeeping for the per-sequence state of a hybrid model's fixed-state layers (a Gated
DeltaNet's convolution and recurrent state; a Mamba-2 layer's alike): plain Python, no torch.

The device memory is KVCache.states (exlcli/model/state_cache.py), `num_slots` slots of every such
layer's state. A running sequence holds one slot from admission until it finishes, is cancelled or
is preempted (it then recomputes from its prompt: a chunk from position 0 starts from zeros, so a
slot needs no clearing). The scheduler runs at most as many sequences as there are slots, so an
admitted sequence always finds one.
"""

from __future__ import annotations


class OutOfStateSlotsError(RuntimeError):
    pass


class StatePool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("a state pool needs at least one slot")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
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
        assert not free & self._used and free | self._used == set(range(self.num_slots))
