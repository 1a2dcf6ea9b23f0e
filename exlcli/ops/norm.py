"""RMSNorm, alone and fused with the residual add.

On the CPU a decoder's residual stream is fp32 beside bf16 activations (`residual_stream`), as
llama.cpp keeps its hidden state: summing some sixty bf16-rounded layer outputs into a bf16 stream
moves a small model's logits by a tenth of a nat, enough to change its greedy answer. The layers' inputs
(the normed rows the matmuls read) stay bf16. The GPU path keeps a bf16 stream, as its fused kernels take.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from exlcli.ops.cpu import loader as cpu_loader
from exlcli.ops.cpu.args import FusedAddRmsNormArgs, MeanSquaresArgs, RmsNormArgs
from exlcli.ops.cuda import kernels as cuda_kernels
from exlcli.ops.cuda.loader import use_kernels
from exlcli.ops.errors import KernelInputError


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, H]; computed in fp32 as HF does, cast back to x's dtype before the weight multiply.
    # (F.rms_norm without a weight is the same formula in one op: fewer small ops on the CPU path.)
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_kernels(x):
        return cuda_kernels.rms_norm(x, weight, eps)
    if weight.dtype == torch.bfloat16 and cpu_loader.use_cpu_kernels(x) and _cpu_kernels() is not None:
        return rms_norm_cpu(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual; returns (rms_norm(residual), residual). An fp32 residual beside a
    lower-precision x (the CPU's fp32 stream) takes the sum unrounded and gives the norm in x's dtype."""
    if residual.dtype == torch.float32 and x.dtype != torch.float32:
        residual = x.float() + residual
        return weight * F.rms_norm(residual, residual.shape[-1:], eps=eps).to(x.dtype), residual
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def residual_stream(x: torch.Tensor) -> torch.Tensor:
    """The residual stream a decoder starts from x (its first layer's input): fp32 for bf16 rows on the
    CPU (module docstring), else x itself."""
    return x.float() if x.dtype == torch.bfloat16 and x.device.type == "cpu" else x


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if use_kernels(x):
        return cuda_kernels.fused_add_rms_norm(x, residual, weight, eps)
    if (weight.dtype == torch.bfloat16 and residual.dtype in (torch.bfloat16, torch.float32)
            and cpu_loader.use_cpu_kernels(x) and _cpu_kernels() is not None):
        return fused_add_rms_norm_cpu(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's norm: (rms_norm(x + residual), x + residual), or (rms_norm(x), x) without a
    residual (the first layer)."""
    if residual is None:
        return rms_norm(x, weight, eps), residual_stream(x)
    return fused_add_rms_norm(x, residual, weight, eps)


# --- CPU kernels (csrc/cpu/norm.c): bitwise the same as the references above -------------------


@functools.cache
def _cpu_kernels():
    """(rms_norm, fused_add_rms_norm, mean_squares) C functions with their signatures set, or None."""
    fns = tuple(cpu_loader.kernel_function(args, available="exl_norm_available")
                for args in (RmsNormArgs, FusedAddRmsNormArgs, MeanSquaresArgs))
    return fns if all(fns) else None


def cpu_kernel_available() -> bool:
    return _cpu_kernels() is not None


def _check(x: torch.Tensor, weight: torch.Tensor) -> int:
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype != torch.bfloat16 or not t.is_cpu:
            raise KernelInputError(f"CPU rms_norm: {name} must be a bf16 CPU tensor, got {t.dtype} on {t.device}")
    dim = x.shape[-1] if x.dim() else 0
    if dim == 0 or weight.shape != (dim,):
        raise KernelInputError(f"CPU rms_norm: weight of shape {tuple(weight.shape)} does not match rows of "
                               f"size {dim} (x is {tuple(x.shape)})")
    return dim


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The C kernel: x [..., D] bf16 (rows may be a strided view, e.g. heads of a wider row),
    weight [D] bf16 -> a new contiguous bf16 tensor shaped like x."""
    norm = _cpu_kernels()[0]
    dim = _check(x, weight)
    weight, shape = weight.contiguous(), x.shape
    if x.stride(-1) != 1 or x.dim() > 3:
        x = x.reshape(-1, dim) if x.stride(-1) == 1 else x.contiguous()
    if x.dim() == 3:  # [T, heads, D]
        outer, inner, s_outer, s_inner = x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    elif x.dim() == 2:
        outer, inner, s_outer, s_inner = x.shape[0], 1, x.stride(0), 0
    else:
        outer, inner, s_outer, s_inner = 1, 1, 0, 0
    out = torch.empty(*shape, dtype=torch.bfloat16)  # (unpacked sizes parse faster than a tuple)
    args = RmsNormArgs(x=x.data_ptr(), stride_outer=s_outer, stride_inner=s_inner, inner=inner,
                       weight=weight.data_ptr(), out=out.data_ptr(), dim=dim, eps=eps, rows=outer * inner)
    if norm(ctypes.byref(args)):
        raise KernelInputError(f"CPU rms_norm refused x of shape {tuple(shape)}")
    return out


def fused_add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The C kernel: x [..., D] bf16 and residual of its shape, bf16 or fp32 (the fp32 stream) ->
    (normed bf16, x + residual in the residual's dtype), both new."""
    fused = _cpu_kernels()[1]
    dim = _check(x, weight)
    if residual.shape != x.shape or residual.dtype not in (torch.bfloat16, torch.float32) or not residual.is_cpu:
        raise KernelInputError(f"CPU fused_add_rms_norm: residual ({tuple(residual.shape)}, {residual.dtype}) "
                               f"must be bf16 or fp32 shaped like x ({tuple(x.shape)})")
    x, residual, weight = x.contiguous(), residual.contiguous(), weight.contiguous()
    out, new_residual = torch.empty_like(x), torch.empty_like(residual)  # contiguous, as x and residual are
    args = FusedAddRmsNormArgs(x=x.data_ptr(), residual=residual.data_ptr(), residual_out=new_residual.data_ptr(),
                               weight=weight.data_ptr(), out=out.data_ptr(), dim=dim, eps=eps, rows=x.numel() // dim,
                               residual_fp32=int(residual.dtype == torch.float32))
    if fused(ctypes.byref(args)):
        raise KernelInputError(f"CPU fused_add_rms_norm refused x of shape {tuple(x.shape)}")
    return out, new_residual


def mean_squares_cpu(x: torch.Tensor) -> torch.Tensor:
    """The fp32 mean of squares the C norm computes for each row of a bf16 [rows, D] x; the tests
    compare it bit for bit with torch's x.float().pow(2).mean(-1), whose summation order it copies."""
    if x.dtype != torch.bfloat16 or not x.is_cpu or x.dim() != 2 or x.shape[1] == 0:
        raise KernelInputError(f"mean_squares: x must be a bf16 CPU [rows, D], got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.float32)
    _cpu_kernels()[2](ctypes.byref(MeanSquaresArgs(x=x.data_ptr(), dim=x.shape[1], rows=x.shape[0],
                                                   out=out.data_ptr())))
    return out
