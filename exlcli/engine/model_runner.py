"""A step in two halves: `prepare` turns a ScheduledBatch into the host-side StepInputs (the only
place that reads scheduler objects), `execute` stages them onto the device and runs the forward
pass, as a CUDA graph when one fits. Only StepInputs cross between the two, so `execute` could
later run in another process."""

from __future__ import annotations

import torch

from exlcli.engine.scheduler import ScheduledBatch
from exlcli.engine.verify_cost import CPU_VERIFY_COST, CUDA_GRAPHS_VERIFY_COST, VerifyCost
from exlcli.model.interface import CausalLM
from exlcli.model.kv_cache import KVCache
from exlcli.model.kv_shift import apply_key_shifts
from exlcli.model.step_inputs import StepInputs


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.device = model.device
        self.graphs = None  # CUDA graphs of decode steps (exlcli/model/cuda_graphs.py); None on CPU
        if self.device.type == "cuda":
            from exlcli.model.cuda_graphs import make_decode_graphs

            self.graphs = make_decode_graphs(model, kv)
        # what a verify step of n tokens costs against a plain step here (the speculator's cost model):
        # about one step where it replays the decode graphs; run eagerly (the CPU, or CUDA with the graphs
        # off, unmeasured there), the CPU's figures, more the more rows
        self.verify_cost: VerifyCost = CUDA_GRAPHS_VERIFY_COST if self.graphs is not None else CPU_VERIFY_COST
        # a drafter that reads the target's hidden states (MTP): every step runs eagerly and keeps
        # them, every token's after the final norm [T, H] (`hidden`, until the next step)
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Host-side inputs of a step: each item's tokens (known, in flight, drafted), positions,
        KV slots, block table and length, and its last `num_logits` rows as logits rows."""
        page_size = self.kv.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        logits_rows: list[int] = []
        max_pages = max(len(item.seq.pages) for item in batch.items)
        tables = []
        num_groups = self.kv.num_groups  # layer groups past the first: their own tables and slots
        group_tables: list[list[list[int]]] = [[] for _ in range(num_groups - 1)]
        group_slots: list[list[int]] = [[] for _ in range(num_groups - 1)]
        window0 = self.kv.groups[0].window is not None  # (a model whose every layer slides: one window group)
        in_flight: list[tuple[int, int]] = []  # (input row, row of the previous step's sampled ids)
        for item in batch.items:
            seq, n = item.seq, item.num_new_tokens
            begin = seq.num_computed_tokens
            known = seq.token_ids[begin:begin + n]
            for p in range(begin + len(known), begin + n):  # in flight, then drafted
                if p < seq.num_tokens:
                    in_flight.append((len(ids) + p - begin, seq.pending_row(p)))
                    known.append(0)
                else:
                    known.append(item.draft_tokens[p - seq.num_tokens])
            ids.extend(known)
            cached = seq.cache_len  # = begin unless tokens left the middle (a context shift)
            span = range(cached, cached + n)
            positions.extend(span)
            slots.extend(seq.pages[p // page_size] * page_size + p % page_size for p in span)
            seq_lens.append(cached + n)
            starts.append(starts[-1] + n)
            assert item.num_logits is not None  # ScheduledSeq.__post_init__ sets it
            logits_rows.extend(range(starts[-1] - item.num_logits, starts[-1]))
            pages0 = [max(p, 0) for p in seq.pages] if window0 else seq.pages
            tables.append(pages0 + [0] * (max_pages - len(seq.pages)))
            for g, pages in enumerate(seq.group_pages):
                # a window group's freed entries (-1) name page 0, as the padding does: never read
                group_slots[g].extend(pages[p // page_size] * page_size + p % page_size for p in span)
                group_tables[g].append([max(p, 0) for p in pages] + [0] * (max_pages - len(pages)))
        state_slots = copies = snapshots = None
        if self.kv.states is not None:
            state_slots = [item.seq.state_slot for item in batch.items]
            assert None not in state_slots  # a running sequence of a hybrid model holds a slot
            copies = [(item.restore, item.seq.state_slot) for item in batch.items if item.restore is not None]
            snapshots = [(b, *(item.snapshot[:2] if item.snapshot is not None else item.backup))  # type: ignore[misc]
                         for b, item in enumerate(batch.items) if item.snapshot is not None or item.backup is not None]
        return StepInputs(ids, positions, slots, tables, seq_lens, starts, logits_rows, in_flight,
                          key_shifts=list(batch.key_shifts), group_block_tables=group_tables,
                          group_slot_mappings=group_slots,
                          state_slots=state_slots or [],  # type: ignore[arg-type]
                          state_copies=copies or [], state_snapshots=snapshots or [])  # type: ignore[arg-type]

    def execute(self, inputs: StepInputs, prev_ids: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [S, V], one row per entry of inputs.logits_indices. Queued on the device;
        nothing here waits for it. `prev_ids`: the previous step's sampled ids on the device, where
        the tokens in flight come from (device state: it stays on this side of a process boundary)."""
        apply_key_shifts(self.model.config, self.kv, inputs.key_shifts)  # context shifts first
        if inputs.state_copies:  # prefix-cache hits of a hybrid model: their snapshots into their slots
            assert self.kv.states is not None
            for src, dst in inputs.state_copies:
                self.kv.states.copy(src, dst)
        if self.keep_hidden:
            logits, self.hidden = self.model.forward_with_hidden(  # type: ignore[attr-defined]
                inputs.to_batch_inputs(self.device, prev_ids), self.kv)
            return logits
        if self.graphs is not None:
            # a verify step replays the decode graphs as one row per token
            rows = inputs if inputs.is_decode else inputs.as_decode_rows()
            logits = self.graphs.run(rows, prev_ids) if rows is not None else None  # None: no graph fits
            if logits is not None:
                return logits
        return self.model.forward(inputs.to_batch_inputs(self.device, prev_ids), self.kv)
