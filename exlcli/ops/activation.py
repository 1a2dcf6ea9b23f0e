"""SiLU(gate) * up over a fused [T, 2I] gate|up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exlcli.ops._ext import use_kernels


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_kernels(x):
        return torch.ops.exlcli.silu_and_mul(x)
    return silu_and_mul_ref(x)
