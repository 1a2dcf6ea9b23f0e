"""RMSNorm, alone and fused with the residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exlcli.ops._ext import use_kernels


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, H]; computed in fp32 as HF does, cast back to x's dtype before the weight multiply.
    # (F.rms_norm without a weight is the same formula in one op: fewer small ops on the CPU path.)
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_kernels(x):
        return torch.ops.exlcli.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual; returns (rms_norm(residual), residual)."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if use_kernels(x):
        return torch.ops.exlcli.fused_add_rms_norm(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)
