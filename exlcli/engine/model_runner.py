"""Turns a ScheduledBatch into the model's flat BatchInputs and runs the forward pass."""

from __future__ import annotations

import torch

from exlcli.engine.scheduler import ScheduledBatch
from exlcli.model.llama import BatchInputs, KVCache, LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.device = model.device
        self.graphs = None  # CUDA graphs of decode steps (exlcli/model/cuda_graphs.py); None on CPU
        if self.device.type == "cuda":
            from exlcli.model.cuda_graphs import make_decode_graphs, use_decode_linears

            use_decode_linears(model)
            self.graphs = make_decode_graphs(model, kv)

    def build_inputs(self, batch: ScheduledBatch) -> BatchInputs:
        page_size = self.kv.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        logits_rows: list[int] = []
        max_pages = max(len(item.seq.pages) for item in batch.items)
        tables = []
        for item in batch.items:
            seq, n = item.seq, item.num_new_tokens
            begin = seq.num_computed_tokens
            ids.extend(seq.token_ids[begin:begin + n])
            span = range(begin, begin + n)
            positions.extend(span)
            slots.extend(seq.pages[p // page_size] * page_size + p % page_size for p in span)
            seq_lens.append(begin + n)
            starts.append(starts[-1] + n)
            if item.samples:
                logits_rows.append(starts[-1] - 1)
            tables.append(seq.pages + [0] * (max_pages - len(seq.pages)))
        dev = self.device
        return BatchInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=seq_lens,
            query_start_loc=starts,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc_t=torch.tensor(starts, dtype=torch.int32, device=dev),
        )

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """fp32 logits [S, V], one row per item that samples, in batch order."""
        if self.graphs is not None:
            logits = self.graphs.run(batch)  # None unless a pure decode step fits a graph
            if logits is not None:
                return logits
        return self.model.forward(self.build_inputs(batch), self.kv)
