"""One step's inputs as the host builds them (StepInputs: plain lists, no scheduler objects, so they
could cross a process boundary), and their staging onto the device as the model's BatchInputs.

Async scheduling: a token sampled by the step before and not yet read back is a placeholder 0 in
`input_ids`; `in_flight` says which row of that step's sampled ids (still on the device) replaces
it, and `take_in_flight` does so on the device without waiting for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.kv_shift import KeyShift
from exlcli.model.transfer import to_device
from exlcli.ops.attention import MAX_DECODE_QUERIES, decode_query_rows


@dataclass
class StepInputs:
    """Sequence b owns tokens query_start_loc[b]:query_start_loc[b+1], the last ones of its
    seq_lens[b] tokens; the model returns logits for the rows `logits_indices`, in order."""

    input_ids: list[int]  # [T]; 0 where a token is in flight
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T] page * page_size + offset where each token's K/V goes
    block_tables: list[list[int]]  # [B][max_pages], padded with page 0
    seq_lens: list[int]  # [B] tokens of each sequence after this step
    query_start_loc: list[int]  # [B + 1]
    logits_indices: list[int]  # [S] rows of T whose next-token logits are wanted
    in_flight: list[tuple[int, int]] = field(default_factory=list)  # (row of T, row of the previous step's ids)
    key_shifts: list[KeyShift] = field(default_factory=list)  # context shifts applied before the forward
    state_slots: list[int] = field(default_factory=list)  # [B] hybrid models: each one's slot (KVCache.states)
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # (from, to) slots, before the forward
    state_snapshots: list[tuple[int, int, int]] = field(default_factory=list)  # BatchInputs.state_snapshots
    # the KV cache's layer groups 1.. (KVCache.groups): each one's block tables and slot mapping
    group_block_tables: list[list[list[int]]] = field(default_factory=list)
    group_slot_mappings: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        num_tokens = len(self.input_ids)
        if not len(self.positions) == len(self.slot_mapping) == num_tokens:
            raise ValueError("input_ids, positions and slot_mapping must have one entry per token")
        if len(self.query_start_loc) != self.num_seqs + 1 or self.query_start_loc[-1] != num_tokens:
            raise ValueError("query_start_loc must have B + 1 entries ending at the token count")
        if len(self.block_tables) != self.num_seqs:
            raise ValueError("block_tables must have one row per sequence")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def max_pages(self) -> int:
        return len(self.block_tables[0]) if self.block_tables else 0

    @property
    def is_decode(self) -> bool:
        """Every sequence computes one token and wants its logits (what a decode graph replays)."""
        return self.num_seqs > 0 and self.num_tokens == self.num_seqs == len(self.logits_indices)

    def as_decode_rows(self) -> StepInputs | None:
        """A step in which every token wants its logits (a verify step: the last token and the drafts
        after it; plain decode rows beside them) as a decode step of one row per token, or None for
        any other step. Row j of a sequence with k tokens here reads the sequence's block table and
        its keys up to its own position (the length less k - 1 - j): its K and V, and those of the
        rows before it, are written earlier in the same layer. So the step can replay a decode CUDA
        graph, which takes a table and a length per row."""
        starts, lens = self.query_start_loc, self.seq_lens
        if self.state_slots:  # a sequence's state advances once per token, never per row
            return None
        if (self.is_decode or len(self.logits_indices) != self.num_tokens  # (a prompt chunk: fails here, cheaply)
                or self.logits_indices != list(range(self.num_tokens))):
            return None
        if any(not 1 <= starts[b + 1] - starts[b] <= min(MAX_DECODE_QUERIES, lens[b]) for b in range(self.num_seqs)):
            return None
        seq_of_row, row_lens = decode_query_rows(starts, lens)
        return StepInputs(self.input_ids, self.positions, self.slot_mapping,
                          [self.block_tables[b] for b in seq_of_row], row_lens, list(range(self.num_tokens + 1)),
                          self.logits_indices, self.in_flight, self.key_shifts,
                          group_block_tables=[[tables[b] for b in seq_of_row] for tables in self.group_block_tables],
                          group_slot_mappings=self.group_slot_mappings)

    def to_batch_inputs(self, device: torch.device, prev_ids: torch.Tensor | None = None) -> BatchInputs:
        """The eager path's staging: fresh device tensors. `prev_ids`: the previous step's sampled
        ids on the device, where the in-flight tokens are taken from."""
        if device.type == "cpu" and not self.group_block_tables:
            return self._cpu_batch_inputs(prev_ids)
        longs = to_device([self.input_ids, self.positions, self.slot_mapping], torch.long, device)
        if self.in_flight:
            take_in_flight(longs[0], self.in_flight, prev_ids)
        return BatchInputs(
            input_ids=longs[0],
            positions=longs[1],
            slot_mapping=longs[2],
            block_tables=to_device(self.block_tables, torch.int32, device),
            seq_lens=self.seq_lens,
            query_start_loc=self.query_start_loc,
            logits_indices=to_device(self.logits_indices, torch.long, device),
            seq_lens_t=to_device(self.seq_lens, torch.int32, device),
            query_start_loc_t=to_device(self.query_start_loc, torch.int32, device),
            state_slots=self.state_slots or None,
            state_snapshots=self.state_snapshots or None,
            group_block_tables=[to_device(t, torch.int32, device) for t in self.group_block_tables] or None,
            group_slot_mappings=[to_device(m, torch.long, device) for m in self.group_slot_mappings] or None,
        )

    def _cpu_batch_inputs(self, prev_ids: torch.Tensor | None) -> BatchInputs:
        """to_batch_inputs on the CPU: one tensor per dtype, cut into views. On the CPU a decode step's
        layers stream megabytes of weights through the caches, and each torch op after them cost tens of
        microseconds of CPU time (2-core EPYC); here 5 ops stage what took 8."""
        tokens, seqs, pages = self.num_tokens, self.num_seqs, self.max_pages
        longs = torch.tensor(self.input_ids + self.positions + self.slot_mapping + self.logits_indices,
                             dtype=torch.long)
        input_ids, positions, slot_mapping, logits_indices = longs.split(
            [tokens, tokens, tokens, len(self.logits_indices)])
        ints = torch.tensor([p for table in self.block_tables for p in table] + self.seq_lens + self.query_start_loc,
                            dtype=torch.int32)
        block_tables, seq_lens_t, query_start_loc_t = ints.split([seqs * pages, seqs, seqs + 1])
        if self.in_flight:
            take_in_flight(input_ids, self.in_flight, prev_ids)
        return BatchInputs(
            input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
            block_tables=block_tables.view(seqs, pages), seq_lens=self.seq_lens, query_start_loc=self.query_start_loc,
            logits_indices=logits_indices, seq_lens_t=seq_lens_t, query_start_loc_t=query_start_loc_t,
            state_slots=self.state_slots or None, state_snapshots=self.state_snapshots or None)


def take_in_flight(input_ids: torch.Tensor, rows: list[tuple[int, int]], prev_ids: torch.Tensor | None,
                   index: torch.Tensor | None = None) -> None:
    """input_ids[row] = prev_ids[src] for each (row, src), on the device without waiting for it.
    `index`: the rows and sources already on the device as int64 [2, len(rows)] (the graphs stage them)."""
    if prev_ids is None:
        raise RuntimeError("a token in flight has no sampled ids to come from")
    if index is None:
        dst, src = zip(*rows)
        index = to_device([dst, src], torch.long, input_ids.device)
    input_ids.index_copy_(0, index[0], prev_ids.index_select(0, index[1]))
