"""Q5_1: blocks of 32 weights, w = d * q + m, q of 5 bits.

Block (24 bytes): fp16 d | fp16 m | qh, 4 bytes | qs, 16 bytes, both laid out as in Q5_0.

On the CPU with bf16 activations it runs quantized through our C kernel: 5 bits a weight on AVX2,
elsewhere its 8-bit path (q in 0..31 a byte each, with its offset; see cpu_qmatmul.py).
"""

from __future__ import annotations

import torch

from exlcli.ops.formats import cpu_qmatmul, cuda_groups
from exlcli.ops.formats.base import BlockFormat, f16_at
from exlcli.ops.formats.bit_fields import blocks_of, rows_of
from exlcli.ops.formats.q5_0 import five_bit_quants

BLOCK_WEIGHTS = 32
BLOCK_BYTES = 24


def unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks uint8 [N, K / 32 * 24] -> (q [N, K] int32 in 0..31, scale [N, K/32] fp32, offset
    [N, K/32] fp32) with w = q * scale + offset."""
    rows = blocks.shape[0]
    b = blocks_of(blocks, BLOCK_BYTES)
    q = five_bit_quants(b[:, 4:8], b[:, 8:24])
    return q.reshape(rows, -1), f16_at(b, 0).reshape(rows, -1), f16_at(b, 2).reshape(rows, -1)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    b = blocks_of(blocks, BLOCK_BYTES)
    d, m = f16_at(b, 0), f16_at(b, 2)  # [n]
    q = five_bit_quants(b[:, 4:8], b[:, 8:24])
    return rows_of(d[:, None] * q.float() + m[:, None], blocks, BLOCK_BYTES, BLOCK_WEIGHTS)


FORMAT = BlockFormat(name="Q5_1", gguf_type=7, block_weights=BLOCK_WEIGHTS, block_bytes=BLOCK_BYTES,
                     dequantize=dequantize, cpu_linear=cpu_qmatmul.byte_per_weight_linear(unpack, bits=5),
                     cuda_linear=cuda_groups.cuda_linear(unpack, 6))
