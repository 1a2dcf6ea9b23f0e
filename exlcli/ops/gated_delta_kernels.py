"""Gated DeltaNet's compiled kernels (the delta rule and the causal convolution) behind one checked call
each: CUDA (csrc/gated_delta.cu) for CUDA tensors, C (csrc/cpu/gated_delta.c) for bf16 CPU ones; the torch
references of exlcli/ops/gated_delta.py stay the oracle and the path of everything else.

Both kernels take B sequences at once, each a run of rows begin[b] .. end[b] - 1 of the token tensors and a
state slot: read from in_states[in_slots[b]] (-1: zeros, a sequence's start), written after its last
token to out_states[out_slots[b]] (which may be the slot read). Indices are int32 tensors on the tokens'
device; the CUDA kernels read them there, so a decode step captures in a CUDA graph.
"""

from __future__ import annotations

import torch

from exlcli.ops.cpu import gated_delta as cpu_gated_delta
from exlcli.ops.cpu.loader import use_cpu_kernels
from exlcli.ops.cuda import kernels as cuda_kernels
from exlcli.ops.cuda.loader import use_kernels
from exlcli.ops.errors import KernelInputError
from exlcli.ops.gated_delta import unsupported_shape

# On CUDA, a call where some sequence runs this many tokens or more takes the chunkwise kernel (64-token
# chunks, a few small matrix products each); below, the token-by-token one (every decode step). None: never.
CUDA_CHUNKED_MIN_TOKENS: int | None = 32


def available(x: torch.Tensor) -> bool:
    """Whether the kernels run for activations like x (else the references do)."""
    if x.is_cuda:
        return use_kernels(x)
    return use_cpu_kernels(x) and cpu_gated_delta.available()


def _fail(op: str, why: str) -> None:
    raise KernelInputError(f"{op}: {why}")


def _check_index(op: str, rows: int, in_slots: torch.Tensor, out_slots: torch.Tensor, begin: torch.Tensor,
                 end: torch.Tensor, in_count: int, out_count: int) -> None:
    seqs = in_slots.shape[0] if in_slots.dim() == 1 else -1
    for name, t in (("in_slots", in_slots), ("out_slots", out_slots), ("begin", begin), ("end", end)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != seqs or not t.is_contiguous():
            _fail(op, f"{name} must be a contiguous int32 [{seqs}], got {t.dtype} {list(t.shape)}")
    if in_slots.is_cuda or seqs == 0:
        return  # the device's values are not read back (graphs); the kernels trust them
    if int(in_slots.min()) < -1 or int(in_slots.max()) >= in_count or int(out_slots.min()) < 0 \
            or int(out_slots.max()) >= out_count:
        _fail(op, f"a state slot out of range ({in_count} slots to read, {out_count} to write)")
    if int(begin.min()) < 0 or int(end.max()) > rows or bool((end < begin).any()):
        _fail(op, f"token rows out of range (0 .. {rows})")


def check_delta(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, in_states: torch.Tensor,
                in_slots: torch.Tensor, out_states: torch.Tensor, out_slots: torch.Tensor, begin: torch.Tensor,
                end: torch.Tensor, out: torch.Tensor, k_heads: int, k_dim: int) -> None:
    op = "gated delta rule"
    if out_states.dim() != 4 or out_states.dtype != torch.float32 or not out_states.is_contiguous():
        _fail(op, f"out_states must be a contiguous float32 [slots, Hv, Dk, Dv], got {out_states.dtype} "
                  f"{list(out_states.shape)}")
    _, hv, dk, dv = out_states.shape
    if dk != k_dim or k_heads <= 0 or hv % k_heads:
        _fail(op, f"states of {hv} heads of {dk} x {dv} do not fit {k_heads} key heads of {k_dim}")
    if (why := unsupported_shape(2, dk, dv)) is not None:
        _fail(op, why)
    if in_states.shape[1:] != out_states.shape[1:] or in_states.dtype != torch.float32 \
            or not in_states.is_contiguous():
        _fail(op, f"in_states must be a contiguous float32 [slots, {hv}, {dk}, {dv}], got {list(in_states.shape)}")
    width = 2 * k_heads * dk + hv * dv
    if mixed.dim() != 2 or mixed.stride(1) != 1 or mixed.shape[1] < width:
        _fail(op, f"mixed must be [rows, >= {width}] with contiguous rows, got {list(mixed.shape)}")
    if not mixed.is_cuda and mixed.dtype not in (torch.bfloat16, torch.float32):
        _fail(op, f"mixed must be bfloat16 or float32 on the CPU, got {mixed.dtype}")
    rows = mixed.shape[0]
    for name, t in (("g", g), ("beta", beta)):
        if t.dtype != torch.float32 or t.shape != (rows, hv) or not t.is_contiguous():
            _fail(op, f"{name} must be a contiguous float32 [{rows}, {hv}], got {t.dtype} {list(t.shape)}")
    if out.dtype != torch.float32 or out.shape != (rows, hv, dv) or not out.is_contiguous():
        _fail(op, f"out must be a contiguous float32 [{rows}, {hv}, {dv}], got {out.dtype} {list(out.shape)}")
    _check_index(op, rows, in_slots, out_slots, begin, end, in_states.shape[0], out_states.shape[0])


def gated_delta(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, in_states: torch.Tensor,
                in_slots: torch.Tensor, out_states: torch.Tensor, out_slots: torch.Tensor, begin: torch.Tensor,
                end: torch.Tensor, out: torch.Tensor, k_heads: int, k_dim: int, eps: float = 1e-6,
                longest: int = 1) -> None:
    """The delta rule over B sequences: mixed [rows, q | k | v] (the convolution's output; q and k of
    k_heads heads of k_dim, L2-normalized here, q then scaled by k_dim ** -0.5), g and beta fp32
    [rows, Hv]; writes out fp32 [rows, Hv, Dv] and the states (module docstring). `longest`: the most
    tokens a sequence of the call runs (known on the host), which picks the CUDA kernel."""
    check_delta(mixed, g, beta, in_states, in_slots, out_states, out_slots, begin, end, out, k_heads, k_dim)
    scale = k_dim ** -0.5
    if mixed.is_cuda:
        chunked = CUDA_CHUNKED_MIN_TOKENS is not None and longest >= CUDA_CHUNKED_MIN_TOKENS
        cuda_kernels.gated_delta(mixed, g, beta, in_states, in_slots, out_states, out_slots, begin, end, out,
                                 k_heads, scale, eps, chunked)
    else:
        cpu_gated_delta.gated_delta(mixed, g, beta, in_states, in_slots, out_states, out_slots, begin, end, out,
                                    k_heads, k_dim, scale, eps)


def check_conv(x: torch.Tensor, weight: torch.Tensor, in_states: torch.Tensor, in_slots: torch.Tensor,
               out_states: torch.Tensor, out_slots: torch.Tensor, begin: torch.Tensor, end: torch.Tensor,
               out: torch.Tensor) -> None:
    op = "causal conv1d"
    if weight.dim() != 2 or not weight.is_contiguous():
        _fail(op, f"weight must be a contiguous [channels, width], got {list(weight.shape)}")
    channels, width = weight.shape
    if (why := unsupported_shape(width, 16, 16)) is not None:
        _fail(op, why)
    dtype = x.dtype
    if not x.is_cuda and dtype != torch.bfloat16:
        _fail(op, f"x must be bfloat16 on the CPU, got {dtype}")
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != channels:
        _fail(op, f"x must be [rows, {channels}] with contiguous rows, got {list(x.shape)}")
    for name, t in (("weight", weight), ("in_states", in_states), ("out_states", out_states), ("out", out)):
        if t.dtype != dtype:
            _fail(op, f"{name} must be {dtype} as x is, got {t.dtype}")
    for name, t in (("in_states", in_states), ("out_states", out_states)):
        if t.dim() != 3 or t.shape[1:] != (width - 1, channels) or not t.is_contiguous():
            _fail(op, f"{name} must be a contiguous [slots, {width - 1}, {channels}], got {list(t.shape)}")
    if out.shape != x.shape or not out.is_contiguous():
        _fail(op, f"out must be a contiguous {list(x.shape)}, got {list(out.shape)}")
    _check_index(op, x.shape[0], in_slots, out_slots, begin, end, in_states.shape[0], out_states.shape[0])


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, in_states: torch.Tensor, in_slots: torch.Tensor,
                  out_states: torch.Tensor, out_slots: torch.Tensor, begin: torch.Tensor, end: torch.Tensor,
                  out: torch.Tensor) -> None:
    """The causal convolution of width W with SiLU over B sequences: x [rows, C], weight [C, W], states
    [slots, W - 1, C] in x's dtype; writes out [rows, C] and the states (module docstring)."""
    check_conv(x, weight, in_states, in_slots, out_states, out_slots, begin, end, out)
    if x.is_cuda:
        cuda_kernels.causal_conv1d(x, weight, in_states, in_slots, out_states, out_slots, begin, end, out)
    else:
        cpu_gated_delta.causal_conv1d(x, weight, in_states, in_slots, out_states, out_slots, begin, end, out)
