"""One chunk through the model as one sequence, in pieces of at most `ubatch` tokens (chunked prefill
over the chunk's own KV pages), keeping only the logits of the scored positions."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.interface import CausalLM
from exlcli.model.kv_cache import KVCache

PAGE_SIZE = 16


class ChunkRunner:
    """Runs chunks of up to n_ctx tokens; the KV pages are made once and reused by every chunk (a
    chunk writes each slot before any of its queries reads it, so nothing of the last chunk leaks)."""

    def __init__(self, model: CausalLM, n_ctx: int, ubatch: int, kv_dtype: torch.dtype | None = None) -> None:
        """`kv_dtype`: the KV cache's (kv_cache.kv_cache_dtype), default the model's."""
        if ubatch < 1:
            raise ValueError("ubatch must be at least 1")
        self.model = model
        self.ubatch = ubatch
        num_pages = -(-n_ctx // PAGE_SIZE)
        self.kv = KVCache(model.config, num_pages, PAGE_SIZE, model.device, kv_dtype or model.dtype)
        self.block_table = torch.arange(num_pages, dtype=torch.int32, device=model.device)[None, :]

    def logits(self, ids: list[int], first: int, last: int) -> Iterator[torch.Tensor]:
        """fp32 logits [rows, V] of positions first .. last (inclusive) of `ids`, in order, one
        tensor per piece that holds some of them."""
        device = self.model.device
        for start in range(0, last + 1, self.ubatch):
            end = min(start + self.ubatch, last + 1)  # the last token predicts nothing scored
            lo, hi = max(start, first), min(end - 1, last)
            # a piece before the scored half still needs a logits row: the forward selects rows
            # before the final norm; one row costs one lm_head row, and is dropped
            rows = torch.arange(lo - start, hi - start + 1) if lo <= hi else torch.tensor([end - 1 - start])
            positions = torch.arange(start, end)
            batch = BatchInputs(
                input_ids=torch.tensor(ids[start:end], device=device), positions=positions.to(device),
                slot_mapping=positions.to(device), block_tables=self.block_table, seq_lens=[end],
                query_start_loc=[0, end - start], logits_indices=rows.to(device),
                seq_lens_t=torch.tensor([end], dtype=torch.int32, device=device),
                query_start_loc_t=torch.tensor([0, end - start], dtype=torch.int32, device=device))
            out = self.model.forward(batch, self.kv)
            if lo <= hi:
                yield out
