"""Responses kept for `previous_response_id`, GET and DELETE: in memory, at most a given number,
the least recently used dropped first.

Each keeps the object GET returns, the conversation after it (as chat messages, without its
`instructions`, which a next turn does not inherit), and the engine's session name for that
conversation: the next turn runs under the same session, so the engine resumes the pages the last
turn left (engine/sessions.py) and computes only the new tokens. A chain's histories share their
message dicts, so a long chain costs one list of references per turn, not a copy of every turn.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

DEFAULT_MAX_STORED = 1024


@dataclass
class StoredResponse:
    response: dict  # the Response object, as GET returns it
    history: list[dict]  # the chat messages after this response (no instructions)
    session: str | None  # the engine's session of the conversation (already scoped to the key)
    owner: str  # who may read it: a digest of the API key that made it ("" without a key)


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_STORED) -> None:
        if max_responses < 0:
            raise ValueError("max_responses must be >= 0")
        self.max_responses = max_responses
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self.num_dropped = 0  # pushed out by newer ones

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.max_responses == 0:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_responses:
            self._items.popitem(last=False)
            self.num_dropped += 1

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The response if `owner` may see it (another key's is as good as absent)."""
        stored = self._items.get(response_id)
        if stored is None or stored.owner != owner:
            return None
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str, owner: str) -> bool:
        if self.get(response_id, owner) is None:
            return False
        del self._items[response_id]
        return True
