"""Gated DeltaNet's kernels on the CPU (csrc/cpu/gated_delta.c): the gated delta rule and the causal
convolution over B sequences, each sequence's tokens a run of rows (begin[b] .. end[b] - 1) and its state
a slot. exlcli/ops/gated_delta.py holds the torch references and exlcli/ops/gated_delta_kernels.py the
checks and the choice between these, the CUDA ones and the references."""

from __future__ import annotations

import ctypes
import functools

import torch

from exlcli.ops.cpu import loader as cpu_loader
from exlcli.ops.cpu.args import CausalConv1dArgs, GatedDeltaArgs
from exlcli.ops.errors import KernelInputError


@functools.cache
def _delta_kernel():
    return cpu_loader.kernel_function(GatedDeltaArgs, available="exl_gated_delta_available")


@functools.cache
def _conv_kernel():
    return cpu_loader.kernel_function(CausalConv1dArgs, available="exl_gated_delta_available")


def available() -> bool:
    return _delta_kernel() is not None and _conv_kernel() is not None


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def gated_delta(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, in_states: torch.Tensor,
                in_slots: torch.Tensor, out_states: torch.Tensor, out_slots: torch.Tensor, begin: torch.Tensor,
                end: torch.Tensor, out: torch.Tensor, k_heads: int, k_dim: int, scale: float, eps: float) -> None:
    """The checked arguments (gated_delta_kernels.check_delta) to exl_gated_delta."""
    fn = _delta_kernel()
    v_heads, dk, dv = out_states.shape[1:]
    args = GatedDeltaArgs(
        mixed=_ptr(mixed), mixed_stride=mixed.stride(0), mixed_fp32=int(mixed.dtype == torch.float32), pad=0,
        g=_ptr(g), beta=_ptr(beta), in_states=_ptr(in_states), in_slots=_ptr(in_slots), out_states=_ptr(out_states),
        out_slots=_ptr(out_slots), begin=_ptr(begin), end=_ptr(end), num_seqs=in_slots.shape[0], k_heads=k_heads,
        v_heads=v_heads, k_dim=dk, v_dim=dv, scale=scale, eps=eps, out=_ptr(out))
    if fn is None:
        raise KernelInputError(f"CPU gated delta rule: the CPU kernels are unavailable ({cpu_loader.reason()})")
    if fn(ctypes.byref(args)):
        raise KernelInputError(f"CPU gated delta rule refused heads {k_heads}/{v_heads} of {dk}/{dv}")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, in_states: torch.Tensor, in_slots: torch.Tensor,
                  out_states: torch.Tensor, out_slots: torch.Tensor, begin: torch.Tensor, end: torch.Tensor,
                  out: torch.Tensor) -> None:
    """The checked arguments (gated_delta_kernels.check_conv) to exl_causal_conv1d."""
    fn = _conv_kernel()
    channels, width = weight.shape
    args = CausalConv1dArgs(
        x=_ptr(x), x_stride=x.stride(0), weight=_ptr(weight), in_states=_ptr(in_states), in_slots=_ptr(in_slots),
        out_states=_ptr(out_states), out_slots=_ptr(out_slots), begin=_ptr(begin), end=_ptr(end),
        num_seqs=in_slots.shape[0], channels=channels, width=width, out=_ptr(out))
    if fn is None:
        raise KernelInputError(f"CPU causal conv1d: the CPU kernels are unavailable ({cpu_loader.reason()})")
    if fn(ctypes.byref(args)):
        raise KernelInputError(f"CPU causal conv1d refused a width of {width}")
