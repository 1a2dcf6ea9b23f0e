"""The order result lines reach the file: as they finish, or (--ordered) in input order."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Sequencer(Generic[T]):
    """Releases lines to the writer: at once, or (ordered) in input order. A slot may be None
    (nothing to write, e.g. a cancelled request) so that later lines are not held up."""

    def __init__(self, ordered: bool) -> None:
        self.ordered = ordered
        self.next_to_write = 0
        self._waiting: dict[int, T | None] = {}

    def push(self, seq: int, record: T | None) -> list[T]:
        if not self.ordered:
            self.next_to_write += 1
            return [] if record is None else [record]
        self._waiting[seq] = record
        ready = []
        while self.next_to_write in self._waiting:
            item = self._waiting.pop(self.next_to_write)
            self.next_to_write += 1
            if item is not None:
                ready.append(item)
        return ready

    def release_all(self) -> list[T]:
        """Whatever is held, in order (used when a gap will never be filled)."""
        ready = [r for _, r in sorted(self._waiting.items()) if r is not None]
        self._waiting.clear()
        return ready

    @property
    def num_held(self) -> int:
        return len(self._waiting)
