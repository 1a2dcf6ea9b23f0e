"""Linears around other linears, for weights whose blocks read their input in another order.

GPTQ's act-order checkpoints group the input features by a permutation of their own (`g_idx`); the
loader stores those columns group by group (QuantizedWeight.input_order), so the format's own
kernel runs on contiguous groups once x is permuted the same way: `PermutedInputLinear`. Projections
fused into one linear (q|k|v, gate|up) share x, hence one permutation; where their checkpoint
permuted them differently, each keeps its own linear and `SideBySideLinear` joins their outputs.
"""

from __future__ import annotations

from typing import Callable

import torch

from exlcli.ops.formats.base import Linear, normed_rope_by_heads
from exlcli.ops.rope import RopeWrite


class PermutedInputLinear(Linear):
    """inner(x[:, order]): `inner` computes over weights whose column j is input feature order[j]."""

    def __init__(self, inner: Linear, order: torch.Tensor) -> None:
        self.inner = inner
        self.order = order  # int64 [in_features]
        self.out_features, self.in_features = inner.out_features, inner.in_features

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.order), out_dtype)

    def nbytes(self) -> int:
        return self.inner.nbytes() + self.order.numel() * self.order.element_size()


class SideBySideLinear(Linear):
    """The outputs of several linears over one input, concatenated."""

    def __init__(self, parts: list[Linear]) -> None:
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("linears side by side must read inputs of one width")
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.cat([p(x, out_dtype) for p in self.parts], dim=-1)

    def normed_rope_product(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                            eps: float, rope: RopeWrite) -> tuple[torch.Tensor, torch.Tensor]:
        """Where every part does the rope step on its own heads in its kernel (a Q4_K_M file's Q4_K q and k
        and Q6_K v at one or two tokens), one kernel a part; else the parts' products concatenated, then
        rope's kernel."""
        return normed_rope_by_heads(self, x, residual, norm_weight, eps, rope)

    def heads_rope(self, normed: torch.Tensor, rope: RopeWrite,
                   first_head: int) -> Callable[[torch.Tensor], None] | None:
        dim = rope.k_cache.shape[-1]
        writers, head = [], first_head
        for part in self.parts:
            write = part.heads_rope(normed, rope, head) if part.out_features % dim == 0 else None
            if write is None:
                return None
            writers.append(write)
            head += part.out_features // dim

        def write_all(q: torch.Tensor) -> None:
            for write in writers:
                write(q)

        return write_all

    def cpu_qmatmul_parts(self) -> list | None:
        parts = [p.cpu_qmatmul_parts() for p in self.parts]
        joined: list = []
        for args in parts:
            if args is None:
                return None
            joined += args
        return joined

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)
