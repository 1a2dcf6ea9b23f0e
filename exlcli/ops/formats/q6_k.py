"""Q6_K: super-blocks of 256 weights in 16 sub-blocks of 16, w = d * sc[s] * (q - 32), q of 6 bits,
sc int8.

Block (210 bytes): ql, 128 bytes: two halves of 64; byte i of half h holds the low 4 bits of
q[128 * h + i] (low nibble) and q[128 * h + 64 + i] (high) | qh, 64 bytes: two halves of 32; 2-bit
field f of byte i in half h is the top 2 bits of q[128 * h + 32 * f + i] | scales, 16 x int8 | fp16 d.

On the CPU with bf16 activations it runs quantized through our C kernel, one scale per 16 weights, no
offset: 6 bits a weight on AVX2 (q in 0..63, the kernel subtracts 32 * sum(x) per 16), elsewhere its
8-bit path (q - 32 a byte each; see cpu_qmatmul.py).
"""

from __future__ import annotations

import torch

from exlcli.ops.formats import cpu_qmatmul, cuda_groups
from exlcli.ops.formats.base import BlockFormat, f16_at
from exlcli.ops.formats.bit_fields import blocks_of, rows_of, unpack_fields

BLOCK_WEIGHTS = 256
BLOCK_BYTES = 210


def unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks uint8 [N, K / 256 * 210] -> (q [N, K] int32 in -32..31, scale [N, K/16] fp32, offset
    [N, K/16] fp32, all zeros) with w = q * scale + offset per sub-block of 16."""
    rows = blocks.shape[0]
    b = blocks_of(blocks, BLOCK_BYTES)
    n = b.shape[0]
    low = unpack_fields(b[:, 0:128].view(n, 2, 64), 4).reshape(n, 16, 16)
    high = unpack_fields(b[:, 128:192].view(n, 2, 32), 2).reshape(n, 16, 16)
    q = (low | (high << 4)).to(torch.int32) - 32
    step = f16_at(b, 208)[:, None] * b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    return q.reshape(rows, -1), step.reshape(rows, -1), torch.zeros(rows, step.numel() // rows)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    b = blocks_of(blocks, BLOCK_BYTES)
    n = b.shape[0]
    low = unpack_fields(b[:, 0:128].view(n, 2, 64), 4).reshape(n, 16, 16)
    high = unpack_fields(b[:, 128:192].view(n, 2, 32), 2).reshape(n, 16, 16)
    q = (low | (high << 4)).to(torch.int32) - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    step = f16_at(b, 208)[:, None] * scales
    return rows_of(step[..., None] * q.float(), blocks, BLOCK_BYTES, BLOCK_WEIGHTS)


FORMAT = BlockFormat(name="Q6_K", gguf_type=14, block_weights=BLOCK_WEIGHTS, block_bytes=BLOCK_BYTES,
                     dequantize=dequantize, cpu_linear=cpu_qmatmul.byte_per_weight_linear(unpack, bits=6),
                     cuda_linear=cuda_groups.cuda_linear(unpack, 6))
