"""The gated activations over a fused [T, 2I] gate|up projection: SiLU(gate) * up, and gpt-oss's clamped
SwiGLU (`swiglu_clamped`)."""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from exlcli.ops.cpu import loader as cpu_loader
from exlcli.ops.cpu.args import SiluAndMulArgs
from exlcli.ops.cuda import kernels as cuda_kernels
from exlcli.ops.cuda.loader import use_kernels
from exlcli.ops.errors import KernelInputError


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_clamped(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's gated unit over [gate | up] halves (the loader de-interleaves HF's gate and up rows): gate
    clamped above at limit, up to [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1), in fp32, rounded
    once to gate_up's dtype. Plain tensor ops: no host sync (CUDA graphs capture it)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (gate * torch.sigmoid(alpha * gate) * (up + 1)).to(gate_up.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_kernels(x):
        return cuda_kernels.silu_and_mul(x)
    if cpu_loader.use_cpu_kernels(x) and _cpu_kernel() is not None:
        return silu_and_mul_cpu(x)
    return silu_and_mul_ref(x)


# --- CPU kernel (csrc/cpu/activation.c): bitwise the same as the reference above ------------------


@functools.cache
def _cpu_kernel():
    """The C function with its signature set, or None when the CPU kernels are unavailable."""
    return cpu_loader.kernel_function(SiluAndMulArgs, available="exl_activation_available")


def cpu_kernel_available() -> bool:
    return _cpu_kernel() is not None


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """The C kernel: x [..., 2I] bf16 (rows may be strided) -> a new contiguous [..., I] bf16."""
    fn = _cpu_kernel()
    if x.dtype != torch.bfloat16 or not x.is_cpu:
        raise KernelInputError(f"CPU silu_and_mul: x must be a bf16 CPU tensor, got {x.dtype} on {x.device}")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % 2:
        raise KernelInputError(f"CPU silu_and_mul: the last dim of x must be even (gate | up), "
                               f"got shape {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=torch.bfloat16)
    rows = x.reshape(-1, 2 * inter) if x.dim() != 2 or x.stride(-1) != 1 else x
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    args = SiluAndMulArgs(x=rows.data_ptr(), x_stride=rows.stride(0), out=out.data_ptr(), out_stride=inter,
                          inter=inter, rows=rows.shape[0])
    if fn(ctypes.byref(args)):
        raise KernelInputError(f"CPU silu_and_mul refused x of shape {tuple(x.shape)}")
    return out
