"""K and V rows in a cache whose dtype may differ from the activations': the fp8 KV cache
(--kv-cache-dtype fp8) holds e4m3 values with no scale, as vLLM's fp8 cache does with its default
scale of 1. A value is rounded to the activations' dtype first (what a bf16 / fp16 cache would hold),
then to the nearest e4m3, saturating at +-448 (the CUDA kernels' __NV_SATFINITE: csrc/kv_e4m3.cuh).
Reading a row back as bf16 or fp16 is exact.

torch has no index_copy_ for float8 on the CPU, so one-byte caches are written and read through a
uint8 view of the same memory."""

from __future__ import annotations

import torch

FP8_CACHE_DTYPE = torch.float8_e4m3fn


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it, in one rounding (new K and V rows come in the
    activations' dtype; a context shift's rotated keys in fp32)."""
    if x.dtype == dtype:
        return x
    if dtype == FP8_CACHE_DTYPE:
        limit = torch.finfo(dtype).max
        return x.clamp(-limit, limit).to(dtype)  # a NaN stays NaN
    return x.to(dtype)


def _rows(cache_flat: torch.Tensor) -> torch.Tensor:
    return cache_flat.view(torch.uint8) if cache_flat.element_size() == 1 else cache_flat


def write_rows(cache_flat: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """cache_flat[index] = values rounded to the cache's dtype (index_copy_ along dim 0)."""
    stored = to_cache_dtype(values, cache_flat.dtype)
    _rows(cache_flat).index_copy_(0, index, _rows(stored))


def read_rows(cache_flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache_flat[index] in the cache's dtype (index_select along dim 0)."""
    rows = _rows(cache_flat).index_select(0, index)
    return rows.view(cache_flat.dtype) if rows.dtype != cache_flat.dtype else rows
