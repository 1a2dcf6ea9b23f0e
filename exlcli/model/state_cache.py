"""The per-sequence state of the layers whose memory is a fixed size (a Gated DeltaNet's convolution
and recurrent state; a Mamba-2 layer's would be the same kind of thing): device memory in slots,
which the engine's StatePool hands out, one slot a running sequence, beside the K/V pages.

A layer's state is a few tensors (`StateTensor`: a shape and a dtype per slot); the model that owns
the layer says what they mean. A sequence's slot is never cleared: a chunk that starts at position 0
starts from zeros and overwrites it, so a slot handed to a new sequence (or to one recomputing after
a preemption) needs no reset. `copy` moves a slot's every tensor (the prefix cache's snapshots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exlcli.model.config import ModelConfig


@dataclass(frozen=True)
class StateTensor:
    shape: tuple[int, ...]  # per slot
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.tensor([], dtype=self.dtype).element_size()


def state_tensors(config: ModelConfig, dtype: torch.dtype) -> dict[int, tuple[StateTensor, ...]]:
    """Each stateful layer's state tensors (empty for a model without any): a Gated DeltaNet layer
    keeps its last conv_width - 1 inputs of q|k|v ([W-1, C], time-major, in the activations' dtype)
    and its recurrent state ([Hv, Dk, Dv] in fp32)."""
    la = config.linear_attention
    if la is None:
        return {}
    conv = StateTensor((la.conv_width - 1, la.conv_channels), dtype)
    recurrent = StateTensor((la.num_v_heads, la.k_head_dim, la.v_head_dim), torch.float32)
    return {i: (conv, recurrent) for i in config.linear_layers}


class StateCache:
    """tensors[layer][j]: state tensor j of `layer`, [num_slots, *shape]."""

    def __init__(self, config: ModelConfig, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        if num_slots < 1:
            raise ValueError("a state cache needs at least one slot")
        self.num_slots = num_slots
        self.tensors = {layer: [torch.zeros((num_slots, *t.shape), dtype=t.dtype, device=device) for t in kinds]
                        for layer, kinds in state_tensors(config, dtype).items()}

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
        return sum(t.nbytes for kinds in state_tensors(config, dtype).values() for t in kinds)

    def copy(self, src: int, dst: int) -> None:
        """Slot `dst` takes slot `src`'s state (every layer)."""
        for kinds in self.tensors.values():
            for t in kinds:
                t[dst].copy_(t[src])
