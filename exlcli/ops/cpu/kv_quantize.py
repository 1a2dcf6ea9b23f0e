"""The K/V write's quantizer for quantized pages in C (csrc/cpu/attention_quant.c, exl_kv_quantize):
llama.cpp's reference quantizers for q8_0 and q4_0 and the Gaussian codes' scale search for q4h and q3h,
the bytes of ops/kv_quant.py's torch encoder, without its dozens of torch calls per write."""

from __future__ import annotations

import ctypes
import functools

import torch

from exlcli.ops.cpu import loader as cpu_loader
from exlcli.ops.cpu.args import KvQuantizeArgs
from exlcli.ops.kv_quant import KVQuantFormat

FORMATS = {"q8_0": 2, "q4_0": 3, "q4h": 4, "q3h": 5}  # attention_quant.c's EXL_KV_* numbers


@functools.cache
def _kernel():
    return cpu_loader.kernel_function(KvQuantizeArgs, available="exl_paged_attention_quant_available")


def available() -> bool:
    return _kernel() is not None


def encode(values: torch.Tensor, fmt: KVQuantFormat) -> torch.Tensor:
    """Head vectors [..., D] on the CPU (any float dtype) -> their bytes [..., row_bytes(D)]."""
    fn = _kernel()
    assert fn is not None and fmt.name in FORMATS, f"no C quantizer for {fmt.name}"
    dim = values.shape[-1]
    x = values.float().contiguous()
    out = torch.empty(*values.shape[:-1], fmt.row_bytes(dim), dtype=torch.uint8)
    rows = x.numel() // dim if dim else 0
    args = KvQuantizeArgs(x=x.data_ptr(), rows=rows, dim=dim, format=FORMATS[fmt.name], pad=0, out=out.data_ptr())
    if rows and fn(ctypes.byref(args)):
        raise ValueError(f"{fmt.name} rows need a head_dim that is a multiple of 32, got {dim}")
    return out
