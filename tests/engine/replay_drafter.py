"""A drafter for tests whose drafts are mostly right: it replays recorded plain runs."""

from __future__ import annotations


class ReplayDrafter:
    """Proposes the continuation of a recorded run that `token_ids` is a prefix of, with the
    token at position len(token_ids) % 5 of the proposal changed (so some drafts are rejected)."""

    name = "replay"

    def __init__(self, runs: list[list[int]], vocab: int = 512, corrupt: bool = True) -> None:
        self.runs = runs
        self.vocab = vocab
        self.corrupt = corrupt

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        n = len(token_ids)
        for run in self.runs:
            if len(run) > n and run[:n] == token_ids:
                out = run[n:n + max_tokens]
                bad = n % 5
                if self.corrupt and bad < len(out):
                    out[bad] = (out[bad] + 1) % self.vocab
                return out
        return []
