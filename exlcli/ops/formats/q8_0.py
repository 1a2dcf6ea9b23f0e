"""Q8_0: blocks of 32 weights, w = q * d with q in -128..127.

Block layout (34 bytes): fp16 d, then 32 int8. On the CPU with bf16 activations it runs through our C
kernel (cpu_qmatmul.py); torch has no 8-bit CPU matmul of this form, so without the kernel it is
dequantized to a dense weight.
"""

from __future__ import annotations

import torch

from exlcli.ops.formats import cpu_qmatmul, cuda_groups
from exlcli.ops.formats.base import BlockFormat, Linear, QuantizedWeight, f16_at, scaled_blocks
from exlcli.ops.formats.cpu_qmatmul import QuantCpuLinear

BLOCK_WEIGHTS = 32
BLOCK_BYTES = 34


def unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks uint8 [N, K / 32 * 34] -> (q [N, K] int32, scale [N, K/32] fp32, offset [N, K/32] fp32,
    all zeros) with w = q * scale + offset."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, BLOCK_BYTES)
    d = f16_at(b, 0)
    q = b[..., 2:].contiguous().view(torch.int8).to(torch.int32)
    return q.reshape(rows, -1), d, torch.zeros_like(d)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    return scaled_blocks(*unpack(blocks))


def qmatmul_linear(weight: QuantizedWeight, bias: torch.Tensor | None = None) -> QuantCpuLinear:
    """The C kernel's linear (its torch reference runs where the kernel is not built)."""
    built = QuantCpuLinear.from_blocks(weight, 8, bias)
    if built is not None:
        return built
    q, scale, offset = unpack(weight.blocks)
    return QuantCpuLinear(q, scale, offset, bits=8, bias=bias)


def cpu_linear(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
               dtype: torch.dtype) -> Linear | None:
    if dtype != torch.bfloat16 or not cpu_qmatmul.available():
        return None
    return qmatmul_linear(weight, bias)


FORMAT = BlockFormat("Q8_0", gguf_type=8, block_weights=BLOCK_WEIGHTS, block_bytes=BLOCK_BYTES,
                     dequantize=dequantize, cpu_linear=cpu_linear, cuda_linear=cuda_groups.cuda_linear(unpack, 8))
