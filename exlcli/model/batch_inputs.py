"""One step's flat batch of tokens from many sequences, as the model's forward pass takes it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BatchInputs:
    """One step's tokens. Sequence b owns tokens query_start_loc[b]:query_start_loc[b+1]."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: page * page_size + offset where each token's K/V goes
    block_tables: torch.Tensor  # [B, max_pages] int32
    seq_lens: list[int]  # [B] tokens in each sequence after this step
    query_start_loc: list[int]  # [B + 1]
    logits_indices: torch.Tensor  # [S] long: rows of T whose next-token logits are wanted
    seq_lens_t: torch.Tensor | None = None  # [B] int32 on the device (compiled kernels)
    query_start_loc_t: torch.Tensor | None = None  # [B + 1] int32 on the device
    # hybrid models: each sequence's slot of the per-sequence state (KVCache.states), None without one
    state_slots: list[int] | None = None
    # snapshots to take: (sequence, tokens into its chunk, slot): the state after that many of the
    # sequence's tokens of this step is written to that slot as well
    state_snapshots: list[tuple[int, int, int]] | None = None

    def __post_init__(self) -> None:
        num_tokens = self.input_ids.shape[0]
        if not (self.positions.shape[0] == self.slot_mapping.shape[0] == num_tokens):
            raise ValueError("input_ids, positions and slot_mapping must have one entry per token")
        if len(self.query_start_loc) != len(self.seq_lens) + 1 or self.query_start_loc[-1] != num_tokens:
            raise ValueError("query_start_loc must have B + 1 entries ending at the token count")
