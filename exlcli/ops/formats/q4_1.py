"""Q4_1: blocks of 32 weights, w = q * d + m with q in 0..15.

Block layout (20 bytes): fp16 d, fp16 m, then 16 bytes of nibbles (byte j: element j low, element
j + 16 high). On the CPU with bf16 activations it runs through our C kernel (cpu_qmatmul.py), else
through torch's int4 matmul (cpu_int4.py), whose (q - 8) * scale + zero form holds q * d + m exactly
with zero = m + 8d.
"""

from __future__ import annotations

import torch

from exlcli.ops.formats import cpu_qmatmul, cuda_groups
from exlcli.ops.formats.base import BlockFormat, Linear, QuantizedWeight, f16_at, low_high_nibbles, scaled_blocks
from exlcli.ops.formats.cpu_int4 import Int4CpuLinear
from exlcli.ops.formats.cpu_qmatmul import QuantCpuLinear

BLOCK_WEIGHTS = 32
BLOCK_BYTES = 20


def unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks uint8 [N, K / 32 * 20] -> (q [N, K] int32, scale [N, K/32] fp32, offset [N, K/32] fp32)
    with w = q * scale + offset."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, BLOCK_BYTES)
    return low_high_nibbles(b[..., 4:]).reshape(rows, -1), f16_at(b, 0), f16_at(b, 2)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    return scaled_blocks(*unpack(blocks))


def qmatmul_linear(weight: QuantizedWeight, bias: torch.Tensor | None = None) -> QuantCpuLinear:
    """The C kernel's linear (its torch reference runs where the kernel is not built)."""
    built = QuantCpuLinear.from_blocks(weight, 4, bias)
    if built is not None:
        return built
    q, scale, offset = unpack(weight.blocks)
    return QuantCpuLinear(q, scale, offset, bits=4, bias=bias)


def int4_linear(weight: QuantizedWeight, bias: torch.Tensor | None = None) -> Int4CpuLinear:
    q, scale, offset = unpack(weight.blocks)
    return Int4CpuLinear(q, scale, offset + 8.0 * scale, bias)


def cpu_linear(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
               dtype: torch.dtype) -> Linear | None:
    if dtype != torch.bfloat16:
        return None
    return qmatmul_linear(weight, bias) if cpu_qmatmul.available() else int4_linear(weight, bias)


FORMAT = BlockFormat("Q4_1", gguf_type=3, block_weights=BLOCK_WEIGHTS, block_bytes=BLOCK_BYTES,
                     dequantize=dequantize, cpu_linear=cpu_linear, cuda_linear=cuda_groups.cuda_linear(unpack, 4))
