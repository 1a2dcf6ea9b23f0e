"""Q5_0: blocks of 32 weights, w = d * (q - 16), q of 5 bits.

Block (22 bytes): fp16 d | qh, 4 bytes: bit i (little-endian) is the top bit of q[i] |
qs, 16 bytes: byte j holds the low 4 bits of q[j] (low nibble) and q[j + 16] (high nibble).

On the CPU with bf16 activations it runs quantized through our C kernel: 5 bits a weight on AVX2 (q in
0..31, the kernel subtracts 16 * sum(x)), elsewhere its 8-bit path (q - 16 a byte each, no offset; see
cpu_qmatmul.py).
"""

from __future__ import annotations

import torch

from exlcli.ops.formats import cpu_qmatmul, cuda_groups
from exlcli.ops.formats.base import BlockFormat, f16_at
from exlcli.ops.formats.bit_fields import blocks_of, rows_of, unpack_fields

BLOCK_WEIGHTS = 32
BLOCK_BYTES = 22


def five_bit_quants(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """qh uint8 [n, 4], qs uint8 [n, 16] -> q int32 [n, 32], values 0..31 (shared with Q5_1)."""
    n = qs.shape[0]
    low = unpack_fields(qs, 4).reshape(n, 32)
    high = unpack_fields(qh, 1).transpose(1, 2).reshape(n, 32)  # bit b of byte i is weight 8 * i + b
    return (low | (high << 4)).to(torch.int32)


def unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks uint8 [N, K / 32 * 22] -> (q [N, K] int32 in -16..15, scale [N, K/32] fp32, offset
    [N, K/32] fp32, all zeros) with w = q * scale + offset."""
    rows = blocks.shape[0]
    b = blocks_of(blocks, BLOCK_BYTES)
    d = f16_at(b, 0).reshape(rows, -1)
    q = five_bit_quants(b[:, 2:6], b[:, 6:22]) - 16
    return q.reshape(rows, -1), d, torch.zeros_like(d)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    b = blocks_of(blocks, BLOCK_BYTES)
    d = f16_at(b, 0)  # [n]
    q = five_bit_quants(b[:, 2:6], b[:, 6:22]) - 16
    return rows_of(d[:, None] * q.float(), blocks, BLOCK_BYTES, BLOCK_WEIGHTS)


FORMAT = BlockFormat(name="Q5_0", gguf_type=6, block_weights=BLOCK_WEIGHTS, block_bytes=BLOCK_BYTES,
                     dequantize=dequantize, cpu_linear=cpu_qmatmul.byte_per_weight_linear(unpack, bits=5),
                     cuda_linear=cuda_groups.cuda_linear(unpack, 6))
