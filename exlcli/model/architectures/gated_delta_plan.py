"""Where a step's Gated DeltaNet kernels (exlcli/ops/gated_delta_kernels.py) read and write, built once a
forward pass for all its linear layers: every sequence of the batch, decode token or prompt chunk, in one
call of each kernel, its state read from its slot (or zeros where its chunk starts the sequence) and the
state after it written to row b of a fresh buffer; the buffers replace the slots once the whole pass has
run (Qwen3NextModel).

A snapshot inside a chunk (BatchInputs.state_snapshots: the state after `cut` of the chunk's tokens, for
the prefix cache) splits it: the first call runs the sequence's first `cut` tokens, whose state is the
snapshot, and a second call runs the rest from there. A snapshot at a chunk's end is its final state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exlcli.model.batch_inputs import BatchInputs


def _int32(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).to(device)


@dataclass
class KernelCall:
    """One call's index tensors (int32 on the device): per sequence, the state read (in_slots: a slot,
    or a row of the first call's buffers for a second call; -1 zeros), its tokens begin .. end - 1 and
    the buffer row written (out_slots, 0 .. B - 1)."""

    in_slots: torch.Tensor
    out_slots: torch.Tensor
    begin: torch.Tensor
    end: torch.Tensor
    longest: int  # the most tokens a sequence runs in this call


@dataclass
class DeltaPlan:
    first: KernelCall
    second: KernelCall | None  # the rest of the split chunks, from the first call's buffers
    slots: torch.Tensor  # [B] the sequences' slots: the first call's buffers go there
    split_slots: torch.Tensor | None  # the split sequences' slots: the second call's buffers go there
    snapshot_rows: torch.Tensor | None  # rows of the first call's buffers that are snapshots
    snapshot_slots: torch.Tensor | None  # and the slots they go to

    @classmethod
    def build(cls, batch: BatchInputs, device: torch.device) -> DeltaPlan:
        assert batch.state_slots is not None  # a hybrid model's step carries its sequences' slots
        qsl, lens, slots = batch.query_start_loc, batch.seq_lens, batch.state_slots
        cuts = {s: (cut, slot) for s, cut, slot in batch.state_snapshots or ()}
        in_slots, begin, end = [], [], []
        split_rows, split_begin, split_end, split_slots = [], [], [], []
        for s, slot in enumerate(slots):
            start, stop = qsl[s], qsl[s + 1]
            in_slots.append(-1 if lens[s] == stop - start else slot)  # a chunk at position 0 starts from zeros
            cut = stop - start if s not in cuts else min(cuts[s][0], stop - start)
            begin.append(start)
            end.append(start + cut)
            if start + cut < stop:
                split_rows.append(s)
                split_begin.append(start + cut)
                split_end.append(stop)
                split_slots.append(slot)
        count = len(slots)
        first = KernelCall(_int32(in_slots, device), _int32(list(range(count)), device), _int32(begin, device),
                           _int32(end, device), max((e - b for b, e in zip(begin, end)), default=0))
        second = None
        if split_rows:
            second = KernelCall(_int32(split_rows, device), _int32(list(range(len(split_rows))), device),
                                _int32(split_begin, device), _int32(split_end, device),
                                max(e - b for b, e in zip(split_begin, split_end)))
        snaps = sorted(cuts.items())
        return cls(first, second, _int32(slots, device).long(),
                   _int32(split_slots, device).long() if split_rows else None,
                   _int32([s for s, _ in snaps], device).long() if snaps else None,
                   _int32([slot for _, (_, slot) in snaps], device).long() if snaps else None)
