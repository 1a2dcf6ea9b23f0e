"""The text cut into chunks of n_ctx tokens, as llama-perplexity cuts it."""

from __future__ import annotations

from dataclasses import dataclass

from exlcli.errors import ExlcliError


@dataclass(frozen=True)
class ChunkPlan:
    n_ctx: int
    tokens: list[int]  # the text's tokens (with the BOS the tokenizer adds), all of them
    num_chunks: int
    bos_token_id: int | None  # replaces each chunk's first token when the model adds a BOS

    def __post_init__(self) -> None:
        if not (2 <= self.n_ctx and 1 <= self.num_chunks <= len(self.tokens) // self.n_ctx):
            raise ValueError(f"{self.num_chunks} chunks of {self.n_ctx} tokens do not fit {len(self.tokens)} tokens")

    @property
    def first_scored(self) -> int:
        """Position of the first logits row scored: it predicts the token at first_scored + 1."""
        return self.n_ctx // 2

    @property
    def scored_per_chunk(self) -> int:
        return self.n_ctx - 1 - self.first_scored

    def chunk(self, i: int) -> list[int]:
        """The n_ctx tokens of chunk i, as the model reads them (the first one BOS where it adds one)."""
        ids = self.tokens[i * self.n_ctx:(i + 1) * self.n_ctx]
        return [self.bos_token_id, *ids[1:]] if self.bos_token_id is not None else ids

    def targets(self, i: int) -> list[int]:
        """The tokens chunk i is scored on: its original tokens at first_scored + 1 .. n_ctx - 1."""
        start = i * self.n_ctx
        return self.tokens[start + self.first_scored + 1:start + self.n_ctx]

    def used_tokens(self) -> list[int]:
        """Every token of the chunks, as the text tokenized (llama.cpp saves these with the logits)."""
        return self.tokens[:self.num_chunks * self.n_ctx]


def plan_chunks(tokens: list[int], n_ctx: int, max_chunks: int | None, bos_token_id: int | None) -> ChunkPlan:
    """The chunks; an ExlcliError with llama-perplexity's message for a text shorter than 2 * n_ctx."""
    if n_ctx < 4:
        raise ExlcliError(f"--ctx-size must be at least 4, got {n_ctx}")
    if max_chunks is not None and max_chunks < 1:
        raise ExlcliError(f"--chunks must be at least 1, got {max_chunks}")
    if len(tokens) < 2 * n_ctx:
        raise ExlcliError(f"you need at least {2 * n_ctx} tokens to evaluate perplexity with a context of {n_ctx}; "
                          f"the text tokenizes to only {len(tokens)} tokens")
    available = len(tokens) // n_ctx
    num_chunks = available if max_chunks is None else min(max_chunks, available)
    return ChunkPlan(n_ctx, list(tokens), num_chunks, bos_token_id)
