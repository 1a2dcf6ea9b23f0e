"""Turns a ScheduledBatch into the model's flat BatchInputs and runs the forward pass."""

from __future__ import annotations

import torch

from exlcli.engine.scheduler import ScheduledBatch
from exlcli.engine.transfer import to_device
from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.interface import CausalLM
from exlcli.model.kv_cache import KVCache


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.device = model.device
        self.graphs = None  # CUDA graphs of decode steps (exlcli/model/cuda_graphs.py); None on CPU
        if self.device.type == "cuda":
            from exlcli.model.cuda_graphs import make_decode_graphs

            self.graphs = make_decode_graphs(model, kv)

    def build_inputs(self, batch: ScheduledBatch, prev_ids: torch.Tensor | None = None) -> BatchInputs:
        """`prev_ids`: the previous step's sampled ids on the device, where the input of a
        sequence whose last token is still in flight is taken from (async scheduling)."""
        page_size = self.kv.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        logits_rows: list[int] = []
        max_pages = max(len(item.seq.pages) for item in batch.items)
        tables = []
        in_flight: list[tuple[int, int]] = []  # (input row, row of prev_ids)
        for item in batch.items:
            seq, n = item.seq, item.num_new_tokens
            begin = seq.num_computed_tokens
            known = seq.token_ids[begin:begin + n]
            if len(known) < n:  # only a decode step's one token can be in flight
                in_flight.append((len(ids) + len(known), seq.last_sample_row))
                known = known + [0]
            ids.extend(known)
            span = range(begin, begin + n)
            positions.extend(span)
            slots.extend(seq.pages[p // page_size] * page_size + p % page_size for p in span)
            seq_lens.append(begin + n)
            starts.append(starts[-1] + n)
            if item.samples:
                logits_rows.append(starts[-1] - 1)
            tables.append(seq.pages + [0] * (max_pages - len(seq.pages)))
        dev = self.device
        longs = to_device([ids, positions, slots], torch.long, dev)
        if in_flight:
            take_in_flight(longs[0], in_flight, prev_ids)
        return BatchInputs(
            input_ids=longs[0],
            positions=longs[1],
            slot_mapping=longs[2],
            block_tables=to_device(tables, torch.int32, dev),
            seq_lens=seq_lens,
            query_start_loc=starts,
            logits_indices=to_device(logits_rows, torch.long, dev),
            seq_lens_t=to_device(seq_lens, torch.int32, dev),
            query_start_loc_t=to_device(starts, torch.int32, dev),
        )

    def run(self, batch: ScheduledBatch, prev_ids: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [S, V], one row per item that samples, in batch order. Queued on the
        device; nothing here waits for it."""
        if self.graphs is not None:
            logits = self.graphs.run(batch, prev_ids)  # None unless a pure decode step fits a graph
            if logits is not None:
                return logits
        return self.model.forward(self.build_inputs(batch, prev_ids), self.kv)


def take_in_flight(input_ids: torch.Tensor, rows: list[tuple[int, int]], prev_ids: torch.Tensor | None) -> None:
    """input_ids[row] = prev_ids[src] for each (row, src), on the device without waiting for it."""
    if prev_ids is None:
        raise RuntimeError("a token in flight has no sampled ids to come from")
    dst, src = zip(*rows)
    index = to_device([dst, src], torch.long, input_ids.device)
    input_ids.index_copy_(0, index[0], prev_ids.index_select(0, index[1]))
