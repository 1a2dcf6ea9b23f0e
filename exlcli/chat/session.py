"""Conversation state: the system prompt, the turns, and which of them fit in the model's context.

Turns the context could not hold are not deleted: they stay in the conversation (and in /save)
but fall out of the *window* the model sees, which starts at `first_in_context`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Turn:
    user: str
    assistant: str = ""
    alternatives: list[str] = field(default_factory=list)  # other answers from /n, for /pick


@dataclass
class FitResult:
    prompt_tokens: int  # of the window plus the new message
    dropped: int  # turns newly moved out of the window
    fits: bool  # False: even system prompt + new message alone leave no room for the answer
    # (the window is then left unchanged)


# How full the window is left after a drop: dropping a little more than needed means the next
# turns keep the same prefix (so the engine's prefix cache still hits) instead of sliding by one
# turn, and re-prefilling everything, on every message.
REFILL_FRACTION = 0.75


@dataclass
class Conversation:
    system: str | None = None
    turns: list[Turn] = field(default_factory=list)
    first_in_context: int = 0

    def window(self) -> list[Turn]:
        return self.turns[self.first_in_context:]

    def messages(self, pending_user: str | None = None) -> list[dict]:
        """Chat messages the model sees: system prompt, the turns in the window, a new message."""
        out: list[dict] = []
        if self.system:
            out.append({"role": "system", "content": self.system})
        for turn in self.window():
            out.append({"role": "user", "content": turn.user})
            out.append({"role": "assistant", "content": turn.assistant})
        if pending_user is not None:
            out.append({"role": "user", "content": pending_user})
        return out

    def all_messages(self) -> list[dict]:
        """Every message, including turns that fell out of the window (for /save)."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for turn in self.turns:
            out += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": turn.assistant}]
        return out

    def fit(self, pending_user: str, count_tokens: Callable[[list[dict]], int], room: int) -> FitResult:
        """Move the oldest turns out of the window until system + window + `pending_user` take at
        most `room` tokens (the context minus max_tokens). Drops to REFILL_FRACTION of `room` once it
        has to drop at all."""
        used = count_tokens(self.messages(pending_user))
        if used <= room:
            return FitResult(used, 0, True)
        start = self.first_in_context
        target = int(room * REFILL_FRACTION)
        while self.window() and used > target:
            self.first_in_context += 1
            used = count_tokens(self.messages(pending_user))
        if used > room:  # the message alone is too long: refuse it, keep the window as it was
            self.first_in_context = start
            return FitResult(used, 0, False)
        return FitResult(used, self.first_in_context - start, True)

    def add(self, user: str, assistant: str, alternatives: list[str] | None = None) -> Turn:
        turn = Turn(user, assistant, list(alternatives or []))
        self.turns.append(turn)
        return turn

    def pop(self) -> Turn | None:
        """Remove the last turn (for /undo and /retry)."""
        if not self.turns:
            return None
        turn = self.turns.pop()
        self.first_in_context = min(self.first_in_context, len(self.turns))
        return turn

    def clear(self) -> int:
        count = len(self.turns)
        self.turns.clear()
        self.first_in_context = 0
        return count

    @property
    def num_dropped(self) -> int:
        return self.first_in_context
