"""What the loader, engine, runner and graph runner need from a model: `CausalLM`.

Each architecture (exlcli/model/architectures/) builds an object of this shape; nothing above the
model names a model class.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from exlcli.model.attention_spec import AttentionSpec
from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.config import ModelConfig
from exlcli.model.kv_cache import KVCache


@runtime_checkable
class CausalLM(Protocol):
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype  # activations and the KV cache

    def forward(self, batch: BatchInputs, kv: KVCache) -> torch.Tensor:
        """fp32 logits [S, V] for the rows batch.logits_indices; writes the step's K and V into `kv`."""
        ...

    def forward_layers(self, batch: BatchInputs, kv: KVCache, num_layers: int) -> torch.Tensor:
        """forward() through the first `num_layers` layers, then the final norm and LM head (early
        exit: what a self-drafter proposes from); writes the K/V of those layers only."""
        ...

    def forward_hidden(self, batch: BatchInputs, kv: KVCache) -> torch.Tensor:
        """forward() up to the final norm, without the LM head: fp32 hidden states [S, H] for the rows
        batch.logits_indices (what an embedding pools); writes the step's K and V into `kv`."""
        ...

    def attention_specs(self) -> list[AttentionSpec]:
        """Each layer's kind of attention (window, sinks, soft-cap, query scale, rope): what the
        engine sizes a layer's cache by, and what the compiled attention kernels must support."""
        ...

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads."""
        ...

    def resident_bytes(self) -> int:
        """Bytes all its weights take on its device (the engine's memory budget leaves the rest to K/V)."""
        ...

    # -- the fused decode step: a pure decode step of 1 to 4 sequences in fewer kernels ------------
    def fused_decode_unsupported(self) -> str | None:
        """Why fused_decode_forward cannot run this model (None when it can)."""
        ...

    def fused_decode_forward(self, batch: BatchInputs, kv: KVCache) -> torch.Tensor:
        """forward() for a pure decode step (every row samples), same roundings; fp32 logits [rows, V]."""
        ...


@runtime_checkable
class NextTokenHead(Protocol):
    """A model's own multi-token-prediction (MTP, "nextn") layers, which `--speculative mtp` drafts
    with. A model that has them offers `mtp` (None without) and `forward_with_hidden(batch, kv)`:
    forward()'s logits and the hidden state after the final norm of every token of the step [T, H].
    The head's input at position p is the token at p + 1 and the model's hidden state at p (after its final
    norm), its output the logits of the token at p + 2 and its own hidden state at p + 1 (after its
    final norm), which with the token drafted from them is its input at p + 1."""

    config: ModelConfig  # the shape of its own K/V pages (its full-attention layers, no linear ones)

    def forward(self, batch: BatchInputs, hidden: torch.Tensor, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 logits [S, V], hidden states [S, H]) for the rows batch.logits_indices, from the
        tokens batch.input_ids and the hidden states `hidden` [T, H] of the same rows; writes the
        step's K and V into `kv` (a cache of `config`)."""
        ...

