"""Greedy picks over logits rows: each row's argmax and whether the row is fit to sample from, in
one pass over the logits on CUDA (csrc/argmax.cu), in one C call on the CPU (csrc/cpu/argmax.c), and
with torch ops elsewhere (the reference)."""

from __future__ import annotations

import torch

from exlcli.ops.cpu import argmax as cpu_argmax
from exlcli.ops.cuda import kernels as cuda_kernels
from exlcli.ops.cuda.loader import use_kernels


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """bool [S]: rows with a NaN or +Inf, or with no finite value at all. -Inf alone is a legal
    logit (a masked token); such a row still has a distribution to sample from. Computed on the
    logits' device, so reading it back waits for nothing more than the sampled ids do. One pass: the
    row's max is NaN when it holds a NaN (amax propagates it), +Inf with a +Inf, -Inf when nothing is
    finite, and finite otherwise (on one CPU thread 37 us a row of 49,152 logits, not 280 us)."""
    return ~torch.isfinite(logits.amax(-1))


def with_nonfinite_flags(ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """ids [S], then nonfinite_rows(logits) [S] as 0/1 of ids' dtype: one tensor to read back."""
    return torch.cat([ids, nonfinite_rows(logits).to(ids.dtype)])


def argmax_and_nonfinite_ref(logits: torch.Tensor) -> torch.Tensor:
    """int64 [2 S]: the rows' argmax (the first index of the largest value), then nonfinite_rows as 0/1."""
    return with_nonfinite_flags(logits.argmax(-1), logits)


def argmax_and_nonfinite(logits: torch.Tensor) -> torch.Tensor:
    """argmax_and_nonfinite_ref's values; on CUDA one kernel pass over fp32 logits [S, V] instead of
    six torch ops (at batch 64 of a 128K vocabulary, the torch ops' reads alone take about 50 us); on
    the CPU one C call (a row of 32,000 logits: ~150 us of torch ops on one thread)."""
    if logits.device.type == "cpu":
        return cpu_argmax.argmax_and_nonfinite(logits) if cpu_argmax.takes(logits) else argmax_and_nonfinite_ref(logits)
    if (use_kernels(logits) and logits.dim() == 2 and logits.dtype == torch.float32 and logits.is_contiguous()
            and 0 < logits.shape[0] < 65536 and 0 < logits.shape[1]):
        return cuda_kernels.argmax_rows(logits)
    return argmax_and_nonfinite_ref(logits)
