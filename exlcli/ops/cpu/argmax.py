"""Greedy picks over fp32 logits on the CPU in one C call (csrc/cpu/argmax.c): each row's argmax and its
flag for a row unfit to sample from, the values of exlcli/ops/argmax.py's reference. On one thread torch's
six ops take about 150 us for a row of 32,000 logits; the kernel, a few microseconds."""

from __future__ import annotations

import ctypes
import functools

import torch

from exlcli.ops import backend
from exlcli.ops.cpu import loader as cpu_loader
from exlcli.ops.cpu.args import ArgmaxArgs


@functools.cache
def _kernel():
    """The C function with its signature set, or None when the CPU kernels are unavailable."""
    return cpu_loader.kernel_function(ArgmaxArgs, available="exl_argmax_available")


def takes(logits: torch.Tensor) -> bool:
    """True for fp32 logits [S, V] on the CPU whose rows are contiguous, where the kernels are on."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[1] > 0 and logits.stride(1) == 1 and logits.stride(0) >= logits.shape[1]
            and not backend.reference_forced() and cpu_loader.lib() is not None and _kernel() is not None)


def argmax_and_nonfinite(logits: torch.Tensor) -> torch.Tensor:
    """int64 [2 S]: the rows' argmax, then 1 for each row whose max is not finite (`takes(logits)` holds)."""
    rows, vocab = logits.shape
    out = torch.empty(2 * rows, dtype=torch.int64)
    if rows:
        args = ArgmaxArgs(logits=logits.data_ptr(), rows=rows, vocab=vocab, stride=logits.stride(0),
                          out=out.data_ptr())
        rc = _kernel()(ctypes.byref(args))
        if rc:
            raise ValueError(f"CPU argmax: logits of shape {tuple(logits.shape)} (status {rc})")
    return out
