"""Q5_K: Q4_K with a fifth bit, w = d * sc[s] * q - dmin * m[s], q of 5 bits.

Block (176 bytes): fp16 d | fp16 dmin | scales and mins, 12 bytes (kquant_scales) | qh, 32 bytes:
bit s of byte i is the top bit of weight i of sub-block s | qs, 128 bytes: the low 4 bits, as in Q4_K.

On the CPU with bf16 activations it runs quantized through our C kernel, one (scale, offset) per
sub-block of 32: 5 bits a weight on AVX2, elsewhere its 8-bit path (q in 0..31 a byte each; see
cpu_qmatmul.py).
"""

from __future__ import annotations

import torch

from exlcli.ops.formats import cpu_qmatmul, cuda_groups
from exlcli.ops.formats.base import BlockFormat
from exlcli.ops.formats.bit_fields import blocks_of, rows_of, unpack_fields
from exlcli.ops.formats.q4_k import nibble_quants, sub_block_affine

BLOCK_WEIGHTS = 256
BLOCK_BYTES = 176


def unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks uint8 [N, K / 256 * 176] -> (q [N, K] int32 in 0..31, scale [N, K/32] fp32, offset
    [N, K/32] fp32) with w = q * scale + offset per sub-block of 32."""
    rows = blocks.shape[0]
    b = blocks_of(blocks, BLOCK_BYTES)
    step, offset = sub_block_affine(b)
    q = (nibble_quants(b[:, 48:176]) | (unpack_fields(b[:, 16:48], 1) << 4)).to(torch.int32)
    return q.reshape(rows, -1), step.reshape(rows, -1), -offset.reshape(rows, -1)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    b = blocks_of(blocks, BLOCK_BYTES)
    step, offset = sub_block_affine(b)
    q = nibble_quants(b[:, 48:176]) | (unpack_fields(b[:, 16:48], 1) << 4)  # [n, 8, 32]
    return rows_of(step * q.float() - offset, blocks, BLOCK_BYTES, BLOCK_WEIGHTS)


FORMAT = BlockFormat(name="Q5_K", gguf_type=13, block_weights=BLOCK_WEIGHTS, block_bytes=BLOCK_BYTES,
                     dequantize=dequantize, cpu_linear=cpu_qmatmul.byte_per_weight_linear(unpack, bits=5),
                     cuda_linear=cuda_groups.cuda_linear(unpack, 6))
