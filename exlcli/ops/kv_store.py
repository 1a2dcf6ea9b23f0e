"""K and V rows in a cache whose dtype may differ from the activations': the fp8 KV cache
(--kv-cache-dtype fp8) holds e4m3 values with no scale, as vLLM's fp8 cache does with its default
scale of 1. A value is rounded to the activations' dtype first (what a bf16 / fp16 cache would hold),
then to the nearest e4m3, saturating at +-448 (the CUDA kernels' __NV_SATFINITE: csrc/kv_e4m3.cuh).
Reading a row back as bf16 or fp16 is exact.

torch has no index_copy_ for float8 on the CPU, so one-byte caches are written and read through a
uint8 view of the same memory.

A quantized cache (ops/kv_quant.py: q8_0, q4_0, q4h, q3h) is a QuantizedPages of bytes: writing
quantizes the rows, reading dequantizes them, and copying moves the bytes as they are."""

from __future__ import annotations

import torch

from exlcli.ops.cpu import kv_quantize
from exlcli.ops.kv_quant import QuantizedPages, hadamard

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


def write_rows(cache_flat: torch.Tensor | QuantizedPages, index: torch.Tensor, values: torch.Tensor) -> None:
    """cache_flat[index] = values rounded to the cache's dtype, or quantized (index_copy_ along dim 0)."""
    if isinstance(cache_flat, QuantizedPages):
        cache_flat.data.index_copy_(0, index, _encode(cache_flat, values))
        return
    stored = to_cache_dtype(values, cache_flat.dtype)
    _rows(cache_flat).index_copy_(0, index, _rows(stored))


def _encode(pages: QuantizedPages, values: torch.Tensor) -> torch.Tensor:
    """values [..., D] as `pages` store them: on the CPU by the C quantizer (attention_quant.c's
    exl_kv_quantize, the same bytes as the torch encoder), else the torch one."""
    if pages.format.name in kv_quantize.FORMATS and values.device.type == "cpu" and kv_quantize.available():
        return kv_quantize.encode(hadamard(values.float()) if pages.format.rotated else values, pages.format)
    return pages.format.encode(values)


def read_rows(cache_flat: torch.Tensor | QuantizedPages, index: torch.Tensor) -> torch.Tensor:
    """cache_flat[index] in the cache's dtype (index_select along dim 0); a quantized cache's rows
    dequantized to the fp32 values they stand for."""
    if isinstance(cache_flat, QuantizedPages):
        return cache_flat.format.decode(cache_flat.data.index_select(0, index), cache_flat.head_dim)
    rows = _rows(cache_flat).index_select(0, index)
    return rows.view(cache_flat.dtype) if rows.dtype != cache_flat.dtype else rows


def read_stored_rows(cache_flat: torch.Tensor | QuantizedPages, index: torch.Tensor) -> torch.Tensor:
    """read_rows as attention takes them: a rotated type's rows stay rotated (`rotation_of`)."""
    if isinstance(cache_flat, QuantizedPages):
        return cache_flat.format.decode_stored(cache_flat.data.index_select(0, index), cache_flat.head_dim)
    return read_rows(cache_flat, index)


def rotation_of(cache: torch.Tensor | QuantizedPages) -> bool:
    """True when the cache holds its head vectors Hadamard-rotated (kv_quant.hadamard)."""
    return isinstance(cache, QuantizedPages) and cache.format.rotated


def copy_rows(cache_flat: torch.Tensor | QuantizedPages, src: torch.Tensor, dst: torch.Tensor) -> None:
    """cache_flat[dst] = cache_flat[src], bytes as they are (a page copied on write)."""
    data = cache_flat.data if isinstance(cache_flat, QuantizedPages) else _rows(cache_flat)
    data.index_copy_(0, dst, data.index_select(0, src))
